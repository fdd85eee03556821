/* Decode attention over a paged KV cache, for the CPU, reading the cache blocks in place.
 *
 * The PyTorch reference gathers every request's blocks into a contiguous copy before
 * scaled_dot_product_attention reads it again; at batch 64 that copy is a quarter of a
 * decode step. Here each (request, kv head) pair walks its block table once for the keys and
 * once for the values, so the cache is read twice and written never.
 *
 * q, the cache and out are all float32 or all bfloat16; the arithmetic is float32 either
 * way (a bf16 value is the top half of a float32, so widening it is a shift), and bf16
 * output is rounded to nearest even once at the end. Softmax is two-pass (scores, then
 * max/exp/sum), as in the reference. One OpenMP work item per (request, kv head); the query
 * heads of a GQA group share each tile of keys and values, widened to float32 once.
 *
 * The arithmetic is written with GCC vector extensions of 16 floats, which the compiler
 * maps to the machine's vectors (one AVX-512 register, two AVX2 ones, four NEON ones) rather
 * than hoping it vectorises scalar loops (it did not: a scores loop stayed scalar). Scores
 * for 16 keys are summed across lanes together by a shuffle tree instead of one horizontal
 * sum per key. head_dim must be a multiple of 16 and at most 256; 64 and 128 get copies with
 * the size known to the compiler. Built and loaded by kernels/cpu_attention.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_HEAD_DIM 256

typedef float vfloat __attribute__((vector_size(4 * LANES)));
typedef uint32_t vuint __attribute__((vector_size(4 * LANES)));
typedef int32_t vint __attribute__((vector_size(4 * LANES)));
typedef uint16_t vhalf __attribute__((vector_size(2 * LANES)));

typedef struct {
    void *out;
    int64_t out_stride_r, out_stride_h;
    const void *q;
    int64_t q_stride_r, q_stride_h;
    const void *k_cache;
    int64_t kc_stride_b, kc_stride_t, kc_stride_h;
    const void *v_cache;
    int64_t vc_stride_b, vc_stride_t, vc_stride_h;
    const int32_t *block_tables;
    int64_t bt_stride;
    const int32_t *seq_lens;
    int32_t num_reqs, num_heads, num_kv_heads, head_dim, block_size, max_seq_len;
    float scale;
} DecodeArgs;

/* Elements i .. i+15 of a float32 (bf16 == 0) or bfloat16 (bf16 == 1) array, as floats. */
static inline __attribute__((always_inline)) vfloat load_lanes(const void *base, int64_t i, const int bf16)
{
    vfloat v;
    if (!bf16) {
        memcpy(&v, (const float *)base + i, sizeof v);
        return v;
    }
    vhalf h;
    memcpy(&h, (const uint16_t *)base + i, sizeof h);
    const vuint bits = __builtin_convertvector(h, vuint) << 16;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store_lanes(void *base, int64_t i, vfloat v, const int bf16)
{
    if (!bf16) {
        memcpy((float *)base + i, &v, sizeof v);
        return;
    }
    vuint bits;
    memcpy(&bits, &v, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even; no NaNs reach here */
    const vhalf h = __builtin_convertvector(bits >> 16, vhalf);
    memcpy((uint16_t *)base + i, &h, sizeof h);
}

/* r[i] = the sum of the lanes of a[i]: four rounds, each adding the two halves of every
 * segment of a pair of vectors, so 16 horizontal sums cost 45 vector operations. */
static inline __attribute__((always_inline)) vfloat sum_lanes_of_each(vfloat a[LANES])
{
    const vint lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vint hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vint lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vint hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vint lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vint hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vint lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vint hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    for (int k = 0; k < 8; k++)
        a[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], lo8) + __builtin_shuffle(a[2 * k], a[2 * k + 1], hi8);
    for (int k = 0; k < 4; k++)
        a[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], lo4) + __builtin_shuffle(a[2 * k], a[2 * k + 1], hi4);
    for (int k = 0; k < 2; k++)
        a[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], lo2) + __builtin_shuffle(a[2 * k], a[2 * k + 1], hi2);
    return __builtin_shuffle(a[0], a[1], lo1) + __builtin_shuffle(a[0], a[1], hi1);
}

/* The float32 rows of tile `t0` (LANES keys from one block) of `cache` for kv head g: the
 * cache itself in float32; in bf16, the rows widened into `scratch` [LANES, head_dim] once,
 * so the query heads of the group do not each widen them again. */
static inline __attribute__((always_inline)) const float *tile_rows(
    const void *cache, int64_t stride_b, int64_t stride_t, int64_t stride_h, const int32_t *table,
    int32_t bs, int32_t g, int32_t t0, int32_t n, int32_t len, const int head_dim, const int bf16, float *restrict scratch,
    int64_t *row_stride)
{
    const int64_t base = (int64_t)table[t0 / bs] * stride_b + g * stride_h + (t0 % bs) * stride_t;
    /* the next tile sits wherever the block table says, where no hardware prefetcher looks:
     * ask for its rows now so they arrive while this one is worked on */
    if (t0 + LANES < len) {
        const int64_t next = (int64_t)table[(t0 + LANES) / bs] * stride_b + g * stride_h + ((t0 + LANES) % bs) * stride_t;
        const int elem = bf16 ? 2 : 4;
        for (int i = 0; i < LANES; i++)
            for (int byte = 0; byte < head_dim * elem; byte += 64)
                __builtin_prefetch((const char *)cache + (next + i * stride_t) * elem + byte);
    }
    if (!bf16) {
        *row_stride = stride_t;
        return (const float *)cache + base;
    }
    for (int32_t i = 0; i < n; i++)
        for (int c = 0; c < head_dim; c += LANES)
            store_lanes(scratch, (int64_t)i * head_dim + c, load_lanes(cache, base + i * stride_t + c, 1), 0);
    *row_stride = head_dim;
    return scratch;
}

/* One (request, kv head). Scratch: q_f32 and acc [group, head_dim], scores [group,
 * max_seq_len], tile [LANES, head_dim]. */
static inline __attribute__((always_inline)) void attend(
    const DecodeArgs *a, int32_t r, int32_t g, const int head_dim, const int bf16,
    float *restrict q_f32, float *restrict scores, float *restrict acc, float *restrict tile)
{
    const int group = a->num_heads / a->num_kv_heads;
    const int32_t len = a->seq_lens[r];
    const int32_t bs = a->block_size;
    const int32_t *table = a->block_tables + r * a->bt_stride;
    const int64_t q_base = r * a->q_stride_r + (int64_t)g * group * a->q_stride_h;
    const int chunks = head_dim / LANES;
    int64_t stride;

    /* fold the scale into the query: one multiply per element instead of one per score */
    for (int j = 0; j < group; j++)
        for (int c = 0; c < head_dim; c += LANES)
            store_lanes(q_f32, j * head_dim + c, load_lanes(a->q, q_base + j * a->q_stride_h + c, bf16) * a->scale, 0);

    /* LANES keys at a time; a tile never straddles a block, whose size is a multiple of LANES */
    for (int32_t t0 = 0; t0 < len; t0 += LANES) {
        const int32_t n = len - t0 < LANES ? len - t0 : LANES;
        const float *k = tile_rows(a->k_cache, a->kc_stride_b, a->kc_stride_t, a->kc_stride_h, table, bs, g, t0, n, len,
                                   head_dim, bf16, tile, &stride);
        for (int j = 0; j < group; j++) {
            vfloat qv[MAX_HEAD_DIM / LANES];
            for (int c = 0; c < chunks; c++)
                qv[c] = load_lanes(q_f32, j * head_dim + c * LANES, 0);
            vfloat partial[LANES];
            for (int i = 0; i < LANES; i++) {
                vfloat dot = {0};
                if (i < n)
                    for (int c = 0; c < chunks; c++)
                        dot += qv[c] * load_lanes(k, i * stride + c * LANES, 0);
                partial[i] = dot;
            }
            const vfloat s = sum_lanes_of_each(partial);
            memcpy(scores + (int64_t)j * len + t0, &s, sizeof(float) * (size_t)n);
        }
    }

    for (int j = 0; j < group; j++) {
        float *restrict s = scores + (int64_t)j * len;
        float max = s[0];
        for (int32_t t = 1; t < len; t++)
            max = s[t] > max ? s[t] : max;
        float sum = 0.0f;
        for (int32_t t = 0; t < len; t++) {
            s[t] = expf(s[t] - max);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
        for (int32_t t = 0; t < len; t++)
            s[t] *= inv;
    }

    memset(acc, 0, sizeof(float) * (size_t)group * (size_t)head_dim);
    for (int32_t t0 = 0; t0 < len; t0 += LANES) {
        const int32_t n = len - t0 < LANES ? len - t0 : LANES;
        const float *v = tile_rows(a->v_cache, a->vc_stride_b, a->vc_stride_t, a->vc_stride_h, table, bs, g, t0, n, len,
                                   head_dim, bf16, tile, &stride);
        for (int j = 0; j < group; j++) {
            const float *p = scores + (int64_t)j * len + t0;
            vfloat o[MAX_HEAD_DIM / LANES];
            for (int c = 0; c < chunks; c++)
                o[c] = load_lanes(acc, j * head_dim + c * LANES, 0);
            for (int32_t i = 0; i < n; i++)
                for (int c = 0; c < chunks; c++)
                    o[c] += p[i] * load_lanes(v, i * stride + c * LANES, 0);
            for (int c = 0; c < chunks; c++)
                store_lanes(acc, j * head_dim + c * LANES, o[c], 0);
        }
    }

    for (int j = 0; j < group; j++) {
        const int64_t out = r * a->out_stride_r + ((int64_t)g * group + j) * a->out_stride_h;
        for (int c = 0; c < head_dim; c += LANES)
            store_lanes(a->out, out + c, load_lanes(acc, j * head_dim + c, 0), bf16);
    }
}

typedef void (*AttendFn)(const DecodeArgs *, int32_t, int32_t, float *, float *, float *, float *);

#define SPECIALISE(name, head_dim, bf16)                                                                   \
    static void name(const DecodeArgs *a, int32_t r, int32_t g, float *q_f32, float *scores, float *acc, \
                     float *tile)                                                                          \
    {                                                                                                      \
        attend(a, r, g, head_dim, bf16, q_f32, scores, acc, tile);                                         \
    }
SPECIALISE(attend_f32_64, 64, 0)
SPECIALISE(attend_f32_128, 128, 0)
SPECIALISE(attend_f32_any, a->head_dim, 0)
SPECIALISE(attend_bf16_64, 64, 1)
SPECIALISE(attend_bf16_128, 128, 1)
SPECIALISE(attend_bf16_any, a->head_dim, 1)

/* dtype 0: float32, 1: bfloat16. Returns 0; 1 when a thread could not allocate its scratch
 * (nothing is then computed); 2 for a head_dim or block_size the kernel does not take. */
int paged_decode_attention(
    void *out, int64_t out_stride_r, int64_t out_stride_h,
    const void *q, int64_t q_stride_r, int64_t q_stride_h,
    const void *k_cache, int64_t kc_stride_b, int64_t kc_stride_t, int64_t kc_stride_h,
    const void *v_cache, int64_t vc_stride_b, int64_t vc_stride_t, int64_t vc_stride_h,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    int32_t num_reqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
    int32_t max_seq_len, float scale, int32_t dtype)
{
    if (head_dim % LANES != 0 || head_dim > MAX_HEAD_DIM || block_size % LANES != 0)
        return 2;
    const DecodeArgs args = {
        out, out_stride_r, out_stride_h, q, q_stride_r, q_stride_h,
        k_cache, kc_stride_b, kc_stride_t, kc_stride_h, v_cache, vc_stride_b, vc_stride_t, vc_stride_h,
        block_tables, bt_stride, seq_lens, num_reqs, num_heads, num_kv_heads, head_dim, block_size,
        max_seq_len, scale,
    };
    const AttendFn kernels[2][3] = {
        {attend_f32_64, attend_f32_128, attend_f32_any},
        {attend_bf16_64, attend_bf16_128, attend_bf16_any},
    };
    const AttendFn kernel = kernels[dtype != 0][head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2];
    const int group = num_heads / num_kv_heads;
    int failed = 0;
#pragma omp parallel
    {
        float *q_f32 = malloc(sizeof(float) * (size_t)group * (size_t)head_dim);
        float *acc = malloc(sizeof(float) * (size_t)group * (size_t)head_dim);
        float *tile = malloc(sizeof(float) * LANES * (size_t)head_dim);
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)max_seq_len);
        if (q_f32 == NULL || acc == NULL || tile == NULL || scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for collapse(2) schedule(dynamic, 1)
            for (int32_t r = 0; r < num_reqs; r++)
                for (int32_t g = 0; g < num_kv_heads; g++)
                    kernel(&args, r, g, q_f32, scores, acc, tile);
        }
        free(q_f32);
        free(acc);
        free(tile);
        free(scores);
    }
    return failed;
}
