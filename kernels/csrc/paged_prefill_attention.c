/* Causal attention of prefill chunks over a paged KV cache, for the CPU (flash-style: one pass
 * over the keys with an online softmax, the cache read in place).
 *
 * The PyTorch reference gathers each request's keys and values into a contiguous copy and
 * calls scaled_dot_product_attention once per request; on one Zen 4 core that reached 34
 * GFLOP/s at 256 tokens and 60 at 2,048, against 215 for the linear layers of the same step:
 * a fifth of a prefill step of 256-token prompts, half of one of a 2,048-token prompt.
 *
 * A work item is one kv head of up to ITEM_TOKENS consecutive query tokens of one request: its
 * rows are those tokens' query heads of that kv head's GQA group. Row r of request i sits at
 * position seq_len - q_len + t (bottom-right causal, as the reference's mask), and sees keys
 * 0 .. that position. A row's maximum is never -inf: its first block holds key 0, and masked
 * scores are a large finite negative, as -ffast-math assumes no infinities. Items run in reverse
 * order, so the longest (a request's last tokens) start first.
 *
 * In float32 (and bf16 without the dot products below) the item's queries are scaled and widened
 * to float32 once, and it walks its keys KEY_BLOCK at a time, each block widened once into
 * float32 and shared by all its rows: the keys transposed (dims x keys), the values as they are.
 * A block is two small matrix products with the online softmax between them, computed
 * MICRO_ROWS rows at a time by one register-blocked kernel (see micro_product): the scores of
 * those rows, then their softmax (a horizontal max, and a rescaling of a row's output only where
 * its max grew), then their output. On one Zen 3 core, float32, 9 query heads on 3 kv heads, a
 * layer: 8 prompts of 256 tokens 40 -> 20 ms, one of 2,048 tokens 237 -> 126 ms against tiles of
 * LANES keys.
 *
 * The bf16 dot path packs each request's keys and values once per kv head, KEY_TILE keys a tile,
 * into the layout its dot products take, shared by all the items of that head (packed per item,
 * 48 times over for a 1,024-token prompt of 3 kv heads, it took a sixth of the time). Then each
 * item takes its rows a group at a time (as many as keep their output in 16 registers: 4 at
 * head_dim 64), and walks every tile they see with the group's output, running max and sums held
 * in registers throughout, so each key or value vector loaded serves every row of the group. The
 * products are only 2 x head_dim dot products a row and tile, so the softmax between them must
 * stay small: a horizontal max and a rescaling of the output only when a score passes the row's
 * running max (rare after the first tiles), sums kept lane by lane until the end, and e^x in
 * AVX-512 intrinsics with no vector leaving its register (with the vector extensions, the
 * compare's mask and the bf16 weights went through memory, and the softmax took half the time;
 * e^x is still a quarter). Both paths take e^x on vectors (glibc's expf, called per lane, took a
 * third of the time).
 *
 * q and out are both float32 or both bfloat16, and bf16 output is rounded to nearest even
 * once. The cache is in any format of lanes.h (KV_*): other than q's dtype, it is widened (8-bit
 * rows times their scales) as each block of keys is loaded, and the float32 path takes it. In
 * float32 the arithmetic is float32 FMAs. In bf16 on a CPU with AVX512-BF16 (head_dim a multiple
 * of 32), both products run on its dot products, which multiply 16 pairs
 * of bf16 and add into float32 in one instruction: the tile's keys are kept as bf16 pairs
 * transposed, its values as pairs of keys interleaved, and the softmax weights are rounded to
 * bf16 for the values' product, as PyTorch's bf16 flash attention rounds them (the sums that
 * normalise them stay float32). Elsewhere bf16 is widened to float32 and takes the FMAs.
 * Measured on a 2-core Zen 4 (AVX512-BF16), bf16, 9 query heads on 3 kv heads, a layer, the
 * dot path with tiles packed per item -> the one above, one core: 8 prompts of 256 tokens 10.8 ->
 * 8.2 ms, one of 1,024 14.3 -> 10.9 ms, one of 2,048 56 -> 39 ms (SDPA: 29 ms at 1,024); two
 * cores: 4.8 -> 3.9, 7.4 -> 5.2 and 26 -> 20 ms. Built and loaded by kernels/cpu_attention.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "lanes.h"
#include "paged_args.h"

#if defined(__AVX512BF16__) && LANES == 16
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

#define KEY_BLOCK 64
#define MICRO_ROWS 6
#define MICRO_VECS 2
#define KEY_TILE LANES
#define DOT_OUT_REGS 16
#define DOT_MAX_ROWS (DOT_OUT_REGS * LANES / 32)
#define SCORE_CHAINS 8
#define ITEM_TOKENS 64
#define MAX_HEAD_DIM 256
#define MAX_GROUP 64
#define MASKED (-1e30f)

typedef struct {
    int32_t req, kv_head, first, last; /* query tokens first .. last-1 of the request */
} Item;

/* a where `mask` is set (all ones), else b: C has no ?: on vectors */
static inline __attribute__((always_inline)) vfloat select_lanes(vint mask, vfloat a, vfloat b)
{
    vint a_bits, b_bits;
    memcpy(&a_bits, &a, sizeof a);
    memcpy(&b_bits, &b, sizeof b);
    const vint bits = (a_bits & mask) | (b_bits & ~mask);
    vfloat out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* The largest and the sum of a vector's lanes, by halving it log2(LANES) times. */
static inline __attribute__((always_inline)) vfloat swap_halves(vfloat x, int width)
{
    vint index;
    for (int j = 0; j < LANES; j++)
        index[j] = j ^ width;
    return __builtin_shuffle(x, index);
}

static inline __attribute__((always_inline)) float max_of_lanes(vfloat x)
{
    for (int width = LANES / 2; width > 0; width /= 2) {
        const vfloat y = swap_halves(x, width);
        x = select_lanes(x > y, x, y);
    }
    return x[0];
}

static inline __attribute__((always_inline)) float sum_of_lanes(vfloat x)
{
    for (int width = LANES / 2; width > 0; width /= 2)
        x += swap_halves(x, width);
    return x[0];
}

/* e^x lane by lane for x <= 0, to about 2 ulp: 2^n * e^r with n = round(x / ln 2) and
 * |r| <= ln2 / 2 by a degree-6 polynomial; below -87 the result flushes to 0. glibc's scalar
 * expf, which gcc calls for a vector of scores, took a third of the kernel's time. */
static inline __attribute__((always_inline)) vfloat exp_lanes(vfloat x)
{
    const vint underflows = x < -87.0f;
    x = select_lanes(underflows, (vfloat){0} - 87.0f, x);
    /* x <= 0, so truncating x / ln 2 - 1/2 rounds to nearest (-ffast-math would fold the
     * add-and-subtract-2^23 trick away) */
    const vint n_int = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vint);
    const vfloat n = __builtin_convertvector(n_int, vfloat);
    const vfloat r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    vfloat poly = (vfloat){0} + 1.3888949e-3f;
    poly = poly * r + 8.3333910e-3f;
    poly = poly * r + 4.1666646e-2f;
    poly = poly * r + 1.6666667e-1f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    poly = poly * r + 1.0f;
    const vint scale_bits = (n_int + 127) << 23;
    vfloat scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    return select_lanes(underflows, (vfloat){0}, poly * scale);
}

/* rows[i][k] and rows[k][i] swapped for all i, k: the s x s blocks off the diagonal of each
 * 2s x 2s block swapped, for s = LANES / 2 .. 1, one two-input shuffle per vector a round. */
static inline __attribute__((always_inline)) void transpose_lanes(vfloat rows[LANES])
{
    for (int s = LANES / 2; s > 0; s /= 2) {
        vint lo, hi;
        for (int k = 0; k < LANES; k++) {
            lo[k] = k & s ? LANES + k - s : k;
            hi[k] = k & s ? LANES + k : k + s;
        }
        for (int i = 0; i < LANES; i++)
            if (!(i & s)) {
                const vfloat top = rows[i], bottom = rows[i + s];
                rows[i] = __builtin_shuffle(top, bottom, lo);
                rows[i + s] = __builtin_shuffle(top, bottom, hi);
            }
    }
}

/* A block's keys (transposed: kt[d * KEY_BLOCK + j]) and values (v[j * head_dim + d]) as floats,
 * from a cache in format kv (8-bit rows times their scales); keys past `count` are zero. The
 * keys go LANES at a time through transpose_lanes: stored lane by lane they took a sixth of the
 * kernel's time. */
static inline __attribute__((always_inline)) void load_block_as(const PagedArgs *a, const int32_t *table,
                                                               int32_t kv_head, int32_t key0, int32_t count, float *kt,
                                                               float *v, const int kv)
{
    const int32_t d_len = a->head_dim;
    const int size = kv_size(kv);
    if (count < KEY_BLOCK) {
        memset(kt, 0, sizeof(float) * KEY_BLOCK * d_len);
        memset(v, 0, sizeof(float) * KEY_BLOCK * d_len);
    }
    for (int32_t j0 = 0; j0 < count; j0 += LANES) {
        const int n = count - j0 < LANES ? count - j0 : LANES;
        const uint8_t *k_rows[LANES];
        float k_scales[LANES];
        for (int i = 0; i < n; i++) {
            const int32_t key = key0 + j0 + i;
            const int64_t block = table[key / a->block_size], slot = key % a->block_size;
            k_rows[i] = (const uint8_t *)a->k_cache +
                        (block * a->kc_stride_b + slot * a->kc_stride_t + kv_head * a->kc_stride_h) * size;
            k_scales[i] = kv_row_scale(k_rows[i], d_len, kv);
            const uint8_t *v_row = (const uint8_t *)a->v_cache +
                                   (block * a->vc_stride_b + slot * a->vc_stride_t + kv_head * a->vc_stride_h) * size;
            const float v_scale = kv_row_scale(v_row, d_len, kv);
            for (int32_t d = 0; d < d_len; d += LANES) {
                const vfloat v_vec = load_kv_lanes(v_row, d, kv) * v_scale;
                memcpy(v + (j0 + i) * d_len + d, &v_vec, sizeof v_vec);
            }
        }
        for (int32_t d = 0; d < d_len; d += LANES) {
            vfloat rows[LANES];
            for (int i = 0; i < LANES; i++)
                rows[i] = i < n ? load_kv_lanes(k_rows[i], d, kv) * k_scales[i] : (vfloat){0};
            transpose_lanes(rows);
            for (int i = 0; i < LANES; i++)
                memcpy(kt + (d + i) * KEY_BLOCK + j0, &rows[i], sizeof rows[i]);
        }
    }
}

/* load_block_as with the format a constant in each copy, so each loop is compiled for it. */
static inline __attribute__((always_inline)) void load_block(const PagedArgs *a, const int32_t *table, int32_t kv_head,
                                                            int32_t key0, int32_t count, float *kt, float *v)
{
    switch (a->kv) {
    case KV_F32: load_block_as(a, table, kv_head, key0, count, kt, v, KV_F32); break;
    case KV_BF16: load_block_as(a, table, kv_head, key0, count, kt, v, KV_BF16); break;
    case KV_F16: load_block_as(a, table, kv_head, key0, count, kt, v, KV_F16); break;
    case KV_E4M3: load_block_as(a, table, kv_head, key0, count, kt, v, KV_E4M3); break;
    case KV_E5M2: load_block_as(a, table, kv_head, key0, count, kt, v, KV_E5M2); break;
    default: load_block_as(a, table, kv_head, key0, count, kt, v, KV_I8); break;
    }
}

/* The float32 path works on blocks of KEY_BLOCK keys, as two small matrix products with the
 * online softmax between them, MICRO_ROWS rows by MICRO_VECS vectors at a time (AVX2: 12
 * accumulators, two loaded vectors and a broadcast in its 16 registers): per step two loads, a
 * broadcast per row and 2 * MICRO_ROWS fused multiply-adds, the accumulators in registers across
 * the whole head_dim (scores) or block (values). */

/* c[i][0 .. nv * LANES) (+)= sum over k < depth of a[i][k] * b[k][0 .. nv * LANES), for rows
 * i < mr, rows of a, b and c a_stride, b_stride and c_stride apart; c starts from zero unless
 * `accumulate`. The block's two products are this one: the scores (a the scaled queries, b the
 * transposed keys, depth head_dim) and the output (a the softmax weights, b the values, depth
 * the block's keys, accumulating). mr and nv are constants where the caller passes them, so
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void micro_product(const float *a, int64_t a_stride, const float *b,
                                                                int64_t b_stride, int32_t depth, float *c,
                                                                int64_t c_stride, const int accumulate, const int mr,
                                                                const int nv)
{
    vfloat acc[MICRO_ROWS][MICRO_VECS];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) {
            acc[i][v] = (vfloat){0};
            if (accumulate)
                memcpy(&acc[i][v], c + i * c_stride + v * LANES, sizeof acc[i][v]);
        }
    for (int32_t k = 0; k < depth; k++) {
        vfloat bk[MICRO_VECS];
        for (int v = 0; v < nv; v++)
            memcpy(&bk[v], b + k * b_stride + v * LANES, sizeof bk[v]);
        for (int i = 0; i < mr; i++) {
            const vfloat ai = (vfloat){0} + a[i * a_stride + k];
            for (int v = 0; v < nv; v++)
                acc[i][v] += ai * bk[v];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++)
            memcpy(c + i * c_stride + v * LANES, &acc[i][v], sizeof acc[i][v]);
}

/* One row's scores of a block (its first `visible` keys count) turned into their weights in
 * place; the row's running max m and sum l move on, and its output shrinks where the max grew. */
static inline __attribute__((always_inline)) void block_softmax(float *s, float *m, float *l, float *acc,
                                                                int32_t visible, const int32_t d_len)
{
    vint lane;
    for (int j = 0; j < LANES; j++)
        lane[j] = j;
    /* scores stay in s between the passes: a local array of vectors was written in halves and
     * read whole, which stalls store forwarding */
    vfloat top = (vfloat){0} + MASKED;
    for (int c = 0; c < KEY_BLOCK / LANES; c++) {
        vfloat scores;
        memcpy(&scores, s + c * LANES, sizeof scores);
        scores = select_lanes(lane + c * LANES < visible, scores, (vfloat){0} + MASKED);
        memcpy(s + c * LANES, &scores, sizeof scores);
        top = select_lanes(scores > top, scores, top);
    }
    const float block_max = max_of_lanes(top), new_max = block_max > *m ? block_max : *m;
    vfloat sum = {0};
    for (int c = 0; c < KEY_BLOCK / LANES; c++) {
        vfloat scores;
        memcpy(&scores, s + c * LANES, sizeof scores);
        const vfloat e = exp_lanes(scores - new_max);
        sum += e;
        memcpy(s + c * LANES, &e, sizeof e);
    }
    if (new_max != *m) {
        const float correction = exp_lanes((vfloat){0} + (*m - new_max))[0];
        for (int32_t d = 0; d < d_len; d += LANES) {
            vfloat o;
            memcpy(&o, acc + d, sizeof o);
            o *= correction;
            memcpy(acc + d, &o, sizeof o);
        }
        *l *= correction;
        *m = new_max;
    }
    *l += sum_of_lanes(sum);
}

/* Rows [0, mr) (a constant, as nv below) against one block of `count` keys: scores, softmax,
 * values. s is the rows' scratch of KEY_BLOCK scores each; every row sees the block's key 0. */
static inline __attribute__((always_inline)) void attend_block_rows(const float *q, float *acc, float *m, float *l,
                                                                    const int32_t *pos, int32_t key0, int32_t count,
                                                                    const float *kt, const float *v, float *s,
                                                                    const int32_t d_len, const int mr)
{
    const int32_t strip = MICRO_VECS * LANES;
    for (int32_t j0 = 0; j0 < count; j0 += strip) /* KEY_BLOCK is whole strips: padded keys score 0 */
        micro_product(q, d_len, kt + j0, KEY_BLOCK, d_len, s + j0, KEY_BLOCK, 0, mr, MICRO_VECS);
    for (int i = 0; i < mr; i++) {
        const int32_t visible = pos[i] - key0 + 1 < count ? pos[i] - key0 + 1 : count;
        block_softmax(s + i * KEY_BLOCK, m + i, l + i, acc + i * d_len, visible, d_len);
    }
    int32_t d0 = 0;
    for (; d0 + strip <= d_len; d0 += strip)
        micro_product(s, KEY_BLOCK, v + d0, d_len, count, acc + d0, d_len, 1, mr, MICRO_VECS);
    for (; d0 < d_len; d0 += LANES) /* head_dim is whole vectors, not always whole strips */
        micro_product(s, KEY_BLOCK, v + d0, d_len, count, acc + d0, d_len, 1, mr, 1);
}

/* Every row of an item that sees the block of `count` keys at key0, MICRO_ROWS at a time; d_len
 * a constant where the caller passes one. Rows ascend by position, so those are a suffix. */
static inline __attribute__((always_inline)) void attend_block(const float *q, float *acc, float *m, float *l,
                                                               const int32_t *pos, int rows, int32_t key0,
                                                               int32_t count, const float *kt, const float *v,
                                                               float *s, const int32_t d_len)
{
    int r = 0;
    while (r < rows && pos[r] < key0)
        r++;
    for (; r < rows; r += MICRO_ROWS) {
        const float *qr = q + r * d_len;
        float *ar = acc + r * d_len;
        switch (rows - r < MICRO_ROWS ? rows - r : MICRO_ROWS) {
#define ROWS_CASE(n)                                                                                   \
    case n:                                                                                            \
        attend_block_rows(qr, ar, m + r, l + r, pos + r, key0, count, kt, v, s, d_len, n);             \
        break;
            ROWS_CASE(1)
            ROWS_CASE(2)
            ROWS_CASE(3)
            ROWS_CASE(4)
            ROWS_CASE(5)
            ROWS_CASE(6)
#undef ROWS_CASE
        }
    }
}

#if HAVE_BF16_DOT
/* exp_lanes in AVX-512 intrinsics, so that no vector leaves its register: e^x for x <= 0, below
 * -87 exactly 0 (masked keys weigh nothing) */
static inline __attribute__((always_inline)) __m512 exp_ps(__m512 x)
{
    const __mmask16 above_floor = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
    __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(1.3888949e-3f), r, _mm512_set1_ps(8.3333910e-3f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(4.1666646e-2f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.6666667e-1f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(0.5f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(above_floor, _mm512_scalef_ps(poly, n));
}

/* One row's scores of a tile: its online softmax moves on to them, and returns their weights
 * (keys past `visible` weigh 0) and by how much the row's output shrinks first. */
static inline __attribute__((always_inline)) __m512 softmax_step(__m512 scores, __m512 *m, __m512 *l, int32_t visible,
                                                                 __m512 *correction, int *corrected)
{
    const __mmask16 seen = visible >= KEY_TILE ? (__mmask16)0xffff : (__mmask16)((1u << (visible > 0 ? visible : 0)) - 1);
    scores = _mm512_mask_blend_ps(seen, _mm512_set1_ps(MASKED), scores);
    /* the running max (in every lane) moves rarely once a row has seen some keys: only then is
     * there a horizontal max and a correction of the sums and the output */
    *corrected = _mm512_cmp_ps_mask(scores, *m, _CMP_GT_OQ) != 0;
    if (*corrected) {
        const __m512 new_max = _mm512_set1_ps(_mm512_reduce_max_ps(scores));
        *correction = exp_ps(_mm512_sub_ps(*m, new_max));
        *m = new_max;
        *l = _mm512_mul_ps(*l, *correction);
    }
    const __m512 e = exp_ps(_mm512_sub_ps(scores, *m));
    *l = _mm512_add_ps(*l, e); /* lane by lane: one horizontal sum at the end, not one a tile */
    return e;
}

/* The bf16 tile as AVX512-BF16's dot products take it: key pairs transposed, kp[p * KEY_TILE + j]
 * the two bf16 k_j[2p], k_j[2p + 1] as one word, and value pairs interleaved, vp[(j / 2) * d_len + d]
 * the two v_j[d], v_(j+1)[d] (j even). Keys past `count` are zero. */
static inline __attribute__((always_inline)) void load_tile_pairs(const PagedArgs *a, const int32_t *table,
                                                                  int32_t kv_head, int32_t key0, int32_t count,
                                                                  uint32_t *kp, uint32_t *vp)
{
    const int32_t d_len = a->head_dim;
    if (count < KEY_TILE) {
        memset(kp, 0, sizeof(uint32_t) * KEY_TILE * d_len / 2);
        memset(vp, 0, sizeof(uint32_t) * KEY_TILE * d_len / 2);
    }
    for (int32_t j = 0; j < count; j++) {
        const int32_t key = key0 + j;
        const int64_t block = table[key / a->block_size], slot = key % a->block_size;
        const uint16_t *k_row = (const uint16_t *)a->k_cache + block * a->kc_stride_b + slot * a->kc_stride_t +
                                kv_head * a->kc_stride_h;
        const uint16_t *v_row = (const uint16_t *)a->v_cache + block * a->vc_stride_b + slot * a->vc_stride_t +
                                kv_head * a->vc_stride_h;
        for (int32_t pair = 0; pair < d_len / 2; pair++)
            memcpy(kp + pair * KEY_TILE + j, k_row + 2 * pair, sizeof(uint32_t));
        uint16_t *v_pairs = (uint16_t *)(vp + (j / 2) * d_len) + (j & 1);
        for (int32_t d = 0; d < d_len; d++)
            v_pairs[2 * d] = v_row[d];
    }
}

/* Words of one packed tile: its key pairs, then its value pairs. */
static inline int64_t tile_words(int32_t d_len)
{
    return (int64_t)KEY_TILE * d_len;
}

/* Rows attended together on the dot path: as many as keep their output in 16 registers. */
static inline int dot_row_group(int32_t d_len)
{
    return DOT_OUT_REGS * LANES / d_len;
}

/* Rows r < n of one item (their bf16 queries qp[r], positions pos[r], ascending) over every tile
 * they see, on bf16 dot products: each instruction multiplies and sums 16 pairs. Each key or
 * value vector loaded serves all n rows, whose outputs stay in registers from the first tile to
 * the last (n * d_len / LANES of them: dot_row_group). The scores take the queries as pairs
 * (unscaled bf16, the scale applied to the float32 sums), summed in 8 / n chains so the dot
 * products' latency is hidden; the values take the softmax weights rounded to bf16, as
 * PyTorch's CPU flash attention rounds them for its bf16 product, while the sums that normalise
 * them stay float32. d_len and n are constants where the caller passes them, so the loops unroll. */
static inline __attribute__((always_inline)) void attend_rows_dot(const uint32_t *const *qp, const int32_t *pos,
                                                                  const uint32_t *tiles, float scale,
                                                                  const int32_t d_len, const int n,
                                                                  uint16_t *const *out)
{
    const int32_t pairs = d_len / 2, vecs = d_len / LANES;
    const int chains = n >= SCORE_CHAINS ? 1 : SCORE_CHAINS / n;
    __m512 o[DOT_OUT_REGS], l[DOT_MAX_ROWS], m[DOT_MAX_ROWS];
    for (int i = 0; i < n * vecs; i++)
        o[i] = _mm512_setzero_ps();
    for (int r = 0; r < n; r++) {
        l[r] = _mm512_setzero_ps();
        m[r] = _mm512_set1_ps(MASKED);
    }
    const int32_t last_tile = pos[n - 1] / KEY_TILE;
    for (int32_t t = 0; t <= last_tile; t++) {
        const uint32_t *kp = tiles + t * tile_words(d_len), *vp = kp + pairs * KEY_TILE;
        __m512 s[DOT_MAX_ROWS * SCORE_CHAINS];
        for (int i = 0; i < n * chains; i++)
            s[i] = _mm512_setzero_ps();
        for (int32_t pair = 0; pair < pairs; pair += chains)
            for (int c = 0; c < chains; c++) {
                const __m512bh k_pairs = (__m512bh)_mm512_loadu_si512(kp + (pair + c) * KEY_TILE);
                for (int r = 0; r < n; r++)
                    s[r * chains + c] = _mm512_dpbf16_ps(s[r * chains + c],
                                                         (__m512bh)_mm512_set1_epi32((int)qp[r][pair + c]), k_pairs);
            }
        /* each row's weights as bf16 pairs, key pair jp in lane jp of the low half */
        __m512i w[DOT_MAX_ROWS];
        for (int r = 0; r < n; r++) {
            for (int c = 1; c < chains; c++)
                s[r * chains] = _mm512_add_ps(s[r * chains], s[r * chains + c]);
            __m512 correction = _mm512_set1_ps(1.0f);
            int corrected;
            const __m512 e = softmax_step(_mm512_mul_ps(s[r * chains], _mm512_set1_ps(scale)), m + r, l + r,
                                          pos[r] - t * KEY_TILE + 1, &correction, &corrected);
            if (corrected)
                for (int c = 0; c < vecs; c++)
                    o[r * vecs + c] = _mm512_mul_ps(o[r * vecs + c], correction);
            w[r] = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(e));
        }
        for (int jp = 0; jp < KEY_TILE / 2; jp++) {
            __m512bh pair_weights[DOT_MAX_ROWS];
            for (int r = 0; r < n; r++)
                pair_weights[r] = (__m512bh)_mm512_permutexvar_epi32(_mm512_set1_epi32(jp), w[r]);
            for (int c = 0; c < vecs; c++) {
                const __m512bh v_pairs = (__m512bh)_mm512_loadu_si512(vp + jp * d_len + c * LANES);
                for (int r = 0; r < n; r++)
                    o[r * vecs + c] = _mm512_dpbf16_ps(o[r * vecs + c], pair_weights[r], v_pairs);
            }
        }
    }
    for (int r = 0; r < n; r++) {
        const float inverse = 1.0f / _mm512_reduce_add_ps(l[r]);
        for (int c = 0; c < vecs; c++) {
            vfloat row;
            memcpy(&row, &o[r * vecs + c], sizeof row);
            store_lanes(out[r], c * LANES, row * inverse, 1);
        }
    }
}

/* Packs the first `num_tiles` tiles of one request's keys for one kv head into `tiles` (load_tile_pairs). */
static void pack_tiles(const PagedArgs *a, int32_t req, int32_t kv_head, int64_t num_tiles, uint32_t *tiles)
{
    const int32_t num_keys = a->seq_lens[req], d_len = a->head_dim, pairs = d_len / 2;
    const int32_t *table = a->block_tables + req * a->bt_stride;
    for (int32_t t = 0; t < num_tiles; t++) {
        const int32_t key0 = t * KEY_TILE, count = num_keys - key0 < KEY_TILE ? num_keys - key0 : KEY_TILE;
        uint32_t *kp = tiles + t * tile_words(d_len);
        load_tile_pairs(a, table, kv_head, key0, count, kp, kp + pairs * KEY_TILE);
    }
}

/* One item on the dot path, its kv head's tiles packed: dot_row_group rows at a time, the
 * remainder one by one; d_len a constant where the caller passes one. */
static inline __attribute__((always_inline)) void run_item_dot_as(const PagedArgs *a, const Item *item,
                                                                  const uint32_t *tiles, const int32_t d_len)
{
    const int32_t group = a->num_heads / a->num_kv_heads;
    const int32_t q_start = a->query_start_loc[item->req];
    const int32_t q_len = a->query_start_loc[item->req + 1] - q_start;
    const int32_t seq_len = a->seq_lens[item->req];
    const int rows = (item->last - item->first) * group, n = dot_row_group(d_len);
    for (int r0 = 0; r0 < rows;) {
        const int take = rows - r0 >= n ? n : 1;
        const uint32_t *qp[DOT_MAX_ROWS];
        uint16_t *out[DOT_MAX_ROWS];
        int32_t pos[DOT_MAX_ROWS];
        for (int i = 0; i < take; i++) {
            const int32_t token = item->first + (r0 + i) / group, head = item->kv_head * group + (r0 + i) % group;
            pos[i] = seq_len - q_len + token;
            qp[i] = (const uint32_t *)((const uint16_t *)a->q + (int64_t)(q_start + token) * a->q_stride_r +
                                       head * a->q_stride_h);
            out[i] = (uint16_t *)a->out + (int64_t)(q_start + token) * a->out_stride_r + head * a->out_stride_h;
        }
        if (take == n)
            attend_rows_dot(qp, pos, tiles, a->scale, d_len, n, out);
        else
            attend_rows_dot(qp, pos, tiles, a->scale, d_len, 1, out);
        r0 += take;
    }
}

static void run_item_dot(const PagedArgs *a, const Item *item, const uint32_t *tiles)
{
    switch (a->head_dim) {
    case 64: run_item_dot_as(a, item, tiles, 64); break;
    case 128: run_item_dot_as(a, item, tiles, 128); break;
    default: run_item_dot_as(a, item, tiles, a->head_dim); break;
    }
}

/* Requests with at least `min_query_len` rows on the dot path: first each (request, kv head)'s
 * keys and values packed once into tiles, shared by all its items, then the items. Returns 0,
 * or 4 when it cannot allocate the tiles. */
static int run_dot(const PagedArgs *a, const Item *items, int64_t num_items, int32_t min_query_len)
{
    const int32_t kv_heads = a->num_kv_heads;
    int64_t *tile_at = malloc(sizeof(int64_t) * ((int64_t)a->num_reqs * kv_heads + 1));
    if (tile_at == NULL)
        return 4;
    int64_t num_tiles = 0;
    for (int32_t i = 0; i < a->num_reqs; i++) {
        const int32_t q_len = a->query_start_loc[i + 1] - a->query_start_loc[i];
        const int32_t tiles = q_len >= min_query_len && q_len > 0 ? (a->seq_lens[i] + KEY_TILE - 1) / KEY_TILE : 0;
        for (int32_t h = 0; h < kv_heads; h++) {
            tile_at[i * kv_heads + h] = num_tiles;
            num_tiles += tiles;
        }
    }
    tile_at[(int64_t)a->num_reqs * kv_heads] = num_tiles;
    uint32_t *tiles = aligned_alloc(64, (size_t)num_tiles * tile_words(a->head_dim) * sizeof(uint32_t));
    if (tiles == NULL) {
        free(tile_at);
        return 4;
    }
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t rh = 0; rh < (int64_t)a->num_reqs * kv_heads; rh++)
            pack_tiles(a, (int32_t)(rh / kv_heads), (int32_t)(rh % kv_heads), tile_at[rh + 1] - tile_at[rh],
                       tiles + tile_at[rh] * tile_words(a->head_dim));
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = num_items - 1; k >= 0; k--) {
            const Item *item = &items[k];
            run_item_dot(a, item, tiles + tile_at[item->req * kv_heads + item->kv_head] * tile_words(a->head_dim));
        }
    }
    free(tiles);
    free(tile_at);
    return 0;
}

#endif

/* One item on float32 FMAs over blocks of KEY_BLOCK keys (q and out bf16 where `bf16`). */
static void run_item(const PagedArgs *a, const Item *item, float *scratch, const int bf16)
{
    const int32_t d_len = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const int32_t q_start = a->query_start_loc[item->req];
    const int32_t q_len = a->query_start_loc[item->req + 1] - q_start;
    const int32_t seq_len = a->seq_lens[item->req];
    const int32_t *table = a->block_tables + item->req * a->bt_stride;
    const int rows = (item->last - item->first) * group;
    /* the layout of item_scratch_floats; each part whole vectors, so the vfloat sums are aligned */
    float *q = scratch, *acc = q + rows * d_len, *kt = acc + rows * d_len, *v = kt + KEY_BLOCK * d_len;
    float *s = v + KEY_BLOCK * d_len;
    float *sums = s + MICRO_ROWS * KEY_BLOCK, *m = sums + rows;
    int32_t *pos = (int32_t *)(m + rows);

    memset(acc, 0, sizeof(float) * rows * d_len);
    for (int r = 0; r < rows; r++) {
        m[r] = MASKED;
        sums[r] = 0.0f;
    }
    for (int r = 0; r < rows; r++) {
        const int32_t token = item->first + r / group, head = item->kv_head * group + r % group;
        pos[r] = seq_len - q_len + token;
        const int64_t at = (int64_t)(q_start + token) * a->q_stride_r + head * a->q_stride_h;
        for (int32_t d = 0; d < d_len; d += LANES) {
            const vfloat scaled = load_lanes(a->q, at + d, bf16) * a->scale;
            memcpy(q + r * d_len + d, &scaled, sizeof scaled);
        }
    }

    const int32_t num_keys = pos[rows - 1] + 1;
    for (int32_t key0 = 0; key0 < num_keys; key0 += KEY_BLOCK) {
        const int32_t count = num_keys - key0 < KEY_BLOCK ? num_keys - key0 : KEY_BLOCK;
        load_block(a, table, item->kv_head, key0, count, kt, v);
        if (d_len == 64)
            attend_block(q, acc, m, sums, pos, rows, key0, count, kt, v, s, 64);
        else
            attend_block(q, acc, m, sums, pos, rows, key0, count, kt, v, s, d_len);
    }
    for (int r = 0; r < rows; r++) {
        const int32_t token = item->first + r / group, head = item->kv_head * group + r % group;
        const int64_t at = (int64_t)(q_start + token) * a->out_stride_r + head * a->out_stride_h;
        const float inverse = 1.0f / sums[r];
        for (int32_t d = 0; d < d_len; d += LANES) {
            vfloat o;
            memcpy(&o, acc + r * d_len + d, sizeof o);
            store_lanes(a->out, at + d, o * inverse, bf16);
        }
    }
}

/* Floats of a work item's scratch (run_item's layout): q and output rows, a key block and its
 * values, MICRO_ROWS rows of scores, each row's sum, max and position. */
static size_t item_scratch_floats(int64_t max_rows, int32_t head_dim)
{
    return (size_t)(2 * max_rows * head_dim + 2 * KEY_BLOCK * head_dim + MICRO_ROWS * KEY_BLOCK + 3 * max_rows);
}

/* Whether a call with this head_dim, dtype code and cache format runs on bf16 dot products. */
int paged_prefill_attention_uses_bf16_dot(int32_t head_dim, int32_t dtype, int32_t kv)
{
    return HAVE_BF16_DOT && dtype == 1 && kv == KV_BF16 && head_dim % 32 == 0;
}

/* Returns 0, 2 for arguments it does not take, 4 when it cannot allocate its scratch.
 * Requests with fewer than `min_query_len` query rows are left alone (the decode kernel's). */
int paged_prefill_attention(void *out, int64_t out_stride_r, int64_t out_stride_h,
                            const void *q, int64_t q_stride_r, int64_t q_stride_h,
                            const void *k_cache, int64_t kc_stride_b, int64_t kc_stride_t, int64_t kc_stride_h,
                            const void *v_cache, int64_t vc_stride_b, int64_t vc_stride_t, int64_t vc_stride_h,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                            const int32_t *query_start_loc, int32_t num_reqs, int32_t num_heads, int32_t num_kv_heads,
                            int32_t head_dim, int32_t block_size, float scale, int32_t dtype, int32_t kv,
                            int32_t min_query_len)
{
    if (head_dim % LANES || head_dim > MAX_HEAD_DIM || num_kv_heads < 1 || num_heads % num_kv_heads ||
        num_heads / num_kv_heads > MAX_GROUP || block_size < 1 || (dtype != 0 && dtype != 1) || kv < KV_F32 ||
        kv > KV_I8)
        return 2;
    const PagedArgs a = {out, out_stride_r, out_stride_h, q, q_stride_r, q_stride_h,
                          k_cache, kc_stride_b, kc_stride_t, kc_stride_h,
                          v_cache, vc_stride_b, vc_stride_t, vc_stride_h,
                          block_tables, bt_stride, seq_lens, query_start_loc,
                          num_reqs, num_heads, num_kv_heads, head_dim, block_size, 0, scale, kv};
    int64_t num_items = 0;
    for (int32_t i = 0; i < num_reqs; i++) {
        const int32_t q_len = query_start_loc[i + 1] - query_start_loc[i];
        if (q_len >= min_query_len && q_len > 0)
            num_items += (int64_t)(q_len + ITEM_TOKENS - 1) / ITEM_TOKENS * num_kv_heads;
    }
    if (num_items == 0)
        return 0;
    Item *items = malloc(sizeof(Item) * num_items);
    if (items == NULL)
        return 4;
    int64_t n = 0;
    for (int32_t i = 0; i < num_reqs; i++) {
        const int32_t q_len = query_start_loc[i + 1] - query_start_loc[i];
        if (q_len < min_query_len || q_len < 1)
            continue;
        for (int32_t first = 0; first < q_len; first += ITEM_TOKENS)
            for (int32_t h = 0; h < num_kv_heads; h++)
                items[n++] = (Item){i, h, first, first + ITEM_TOKENS < q_len ? first + ITEM_TOKENS : q_len};
    }
    int failed = 0;
#if HAVE_BF16_DOT
    if (paged_prefill_attention_uses_bf16_dot(head_dim, dtype, kv)) {
        failed = run_dot(&a, items, num_items, min_query_len);
        free(items);
        return failed;
    }
#endif
    const int64_t max_rows = (int64_t)ITEM_TOKENS * (num_heads / num_kv_heads);
    const size_t scratch_floats = item_scratch_floats(max_rows, head_dim);
#pragma omp parallel
    {
        float *scratch = aligned_alloc(64, (scratch_floats * sizeof(float) + 63) / 64 * 64);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 4;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = num_items - 1; k >= 0; k--) {
            if (scratch != NULL)
                run_item(&a, &items[k], scratch, dtype == 1);
        }
        free(scratch);
    }
    free(items);
    return failed;
}
