/* Causal attention of prefill chunks over a paged KV cache, for the CPU (flash-style: one pass
 * over the keys with an online softmax, the cache read in place).
 *
 * The PyTorch reference gathers each request's keys and values into a contiguous copy and
 * calls scaled_dot_product_attention once per request; on one Zen 4 core that reached 34
 * GFLOP/s at 256 tokens and 60 at 2,048, against 215 for the linear layers of the same step:
 * a fifth of a prefill step of 256-token prompts, half of one of a 2,048-token prompt.
 *
 * A work item is one kv head of up to ITEM_TOKENS consecutive query tokens of one request: its
 * rows are those tokens' query heads of that kv head's GQA group, scaled and widened to float32
 * once. Row r of request i sits at position seq_len - q_len + t (bottom-right causal, as the
 * reference's mask), and sees keys 0 .. that position. A row's maximum is never -inf: its first
 * block holds key 0, and masked scores are a large finite negative, as -ffast-math assumes no
 * infinities. Items run in reverse order, so the longest (a request's last tokens) start first.
 *
 * In float32 (and bf16 without the dot products below) the item walks its keys KEY_BLOCK at a
 * time, each block widened once into float32 and shared by all its rows: the keys transposed
 * (dims x keys), the values as they are. A block is two small matrix products with the online
 * softmax between them, computed MICRO_ROWS rows at a time by one register-blocked kernel (see
 * micro_product): the scores of those rows, then their softmax (a horizontal max, and a rescaling
 * of a row's output only where its max grew), then their output. On one Zen 3 core, float32,
 * 9 query heads on 3 kv heads, a layer: 8 prompts of 256 tokens 40 -> 20 ms, one of 2,048 tokens
 * 237 -> 126 ms against the tiles of LANES keys this path had before (those the dot path keeps).
 *
 * The bf16 dot path walks KEY_TILE keys at a time, ROW_GROUP rows together, so each key or
 * value vector loaded serves that many rows; their output accumulators live in the item's
 * scratch between tiles. What the softmax costs a tile is kept small, as the products are only
 * 2 x head_dim vector FMAs a row: a horizontal max and a rescaling of the output only when a
 * score passes the row's running max (rare after the first tiles), sums kept lane by lane until
 * the end. Both paths take e^x on vectors (glibc's expf, called per lane, took a third of the
 * time).
 *
 * q and out are both float32 or both bfloat16, and bf16 output is rounded to nearest even
 * once. The cache is in any format of lanes.h (KV_*): other than q's dtype, it is widened (8-bit
 * rows times their scales) as each block of keys is loaded, and the float32 path takes it. In float32 the arithmetic is float32 FMAs. In bf16 on a CPU with AVX512-BF16
 * (head_dim a multiple of 32), both products run on its dot products, which multiply 16 pairs
 * of bf16 and add into float32 in one instruction: the tile's keys are kept as bf16 pairs
 * transposed, its values as pairs of keys interleaved, and the softmax weights are rounded to
 * bf16 for the values' product, as PyTorch's bf16 flash attention rounds them (the sums that
 * normalise them stay float32). Elsewhere bf16 is widened to float32 and takes the FMAs.
 * Measured on one Zen 4 core, bf16, 9 query heads on 3 kv heads, a layer, SDPA -> float32
 * FMAs -> bf16 dot products: 8 prompts of 256 tokens 20 -> 13.4 -> 11.6 ms, one of 2,048
 * tokens 84 -> 79 -> 48 ms. Built and loaded by kernels/cpu_attention.py.
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
#define ROW_GROUP 4
#define SCORE_CHAINS 4
#define OUT_VECS 16
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
/* One row's scores of a tile: its online softmax moves on to them, and returns their weights
 * (keys past `visible` weigh 0) and by how much the row's output shrinks first. */
static inline __attribute__((always_inline)) vfloat softmax_step(vfloat scores, float *m, vfloat *l, int32_t visible,
                                                                 float *correction)
{
    vint lane;
    for (int j = 0; j < KEY_TILE; j++)
        lane[j] = j;
    if (visible < KEY_TILE)
        scores = select_lanes(lane < visible, scores, (vfloat){0} + MASKED);
    /* the running max moves rarely once a row has seen some keys: only then is there a
     * horizontal max and a correction of the sums and the output */
    const vint above = scores > *m;
    uint64_t words[LANES / 2], any = 0;
    memcpy(words, &above, sizeof words);
    for (int w = 0; w < LANES / 2; w++)
        any |= words[w];
    *correction = 1.0f;
    if (any) {
        const float new_max = max_of_lanes(scores);
        *correction = exp_lanes((vfloat){0} + (*m - new_max))[0];
        *m = new_max;
        *l *= *correction;
    }
    const vfloat e = exp_lanes(scores - *m);
    *l += e; /* lane by lane: one horizontal sum at the end, not one a tile */
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

/* attend_rows on bf16 dot products: each instruction multiplies and sums 16 pairs. The scores
 * take the queries as pairs (qp, unscaled bf16, scale applied to the float32 sums); the values
 * take the softmax weights rounded to bf16, as PyTorch's CPU flash attention rounds them for its
 * bf16 product, while the sums that normalise them stay float32. */
static inline __attribute__((always_inline)) void attend_rows_dot(const uint32_t *qp, float *acc, float *m, vfloat *l,
                                                                  const int32_t *visible, const uint32_t *kp,
                                                                  const uint32_t *vp, float scale, const int32_t d_len,
                                                                  const int n)
{
    const int32_t pairs = d_len / 2;
    __m512 s[ROW_GROUP][SCORE_CHAINS];
    const int chains = n == 1 ? SCORE_CHAINS : 1;
    for (int r = 0; r < n; r++)
        for (int c = 0; c < chains; c++)
            s[r][c] = _mm512_setzero_ps();
    for (int32_t pair = 0; pair < pairs; pair += chains)
        for (int c = 0; c < chains; c++) {
            const __m512bh k_pairs = (__m512bh)_mm512_loadu_si512(kp + (pair + c) * KEY_TILE);
            for (int r = 0; r < n; r++)
                s[r][c] = _mm512_dpbf16_ps(s[r][c], (__m512bh)_mm512_set1_epi32((int)qp[r * pairs + pair + c]), k_pairs);
        }
    uint32_t w[ROW_GROUP][KEY_TILE / 2];
    float correction[ROW_GROUP];
    for (int r = 0; r < n; r++) {
        for (int c = 1; c < chains; c++)
            s[r][0] = _mm512_add_ps(s[r][0], s[r][c]);
        vfloat scores;
        memcpy(&scores, &s[r][0], sizeof scores);
        const vfloat e = softmax_step(scores * scale, m + r, l + r, visible[r], correction + r);
        __m512 e_vec;
        memcpy(&e_vec, &e, sizeof e_vec);
        const __m256bh rounded = _mm512_cvtneps_pbh(e_vec);
        memcpy(w[r], &rounded, sizeof w[r]);
    }
    const int chunk = OUT_VECS / n;
    for (int32_t d0 = 0; d0 < d_len; d0 += chunk * LANES) {
        const int vecs = (d_len - d0) / LANES < chunk ? (d_len - d0) / LANES : chunk;
        __m512 o[ROW_GROUP][OUT_VECS];
        for (int r = 0; r < n; r++)
            for (int c = 0; c < vecs; c++) {
                o[r][c] = _mm512_loadu_ps(acc + r * d_len + d0 + c * LANES);
                if (correction[r] != 1.0f)
                    o[r][c] = _mm512_mul_ps(o[r][c], _mm512_set1_ps(correction[r]));
            }
        for (int jp = 0; jp < KEY_TILE / 2; jp++)
            for (int c = 0; c < vecs; c++) {
                const __m512bh v_pairs = (__m512bh)_mm512_loadu_si512(vp + jp * d_len + d0 + c * LANES);
                for (int r = 0; r < n; r++)
                    o[r][c] = _mm512_dpbf16_ps(o[r][c], (__m512bh)_mm512_set1_epi32((int)w[r][jp]), v_pairs);
            }
        for (int r = 0; r < n; r++)
            for (int c = 0; c < vecs; c++)
                _mm512_storeu_ps(acc + r * d_len + d0 + c * LANES, o[r][c]);
    }
}

/* Every row of an item that sees any of the tile starting at key0, ROW_GROUP at a time where
 * it can, on bf16 dot products (q, kt, v pairs); d_len a constant where the caller passes one,
 * so the loops unroll. Rows ascend by position, so those that see the tile are a suffix. */
static inline __attribute__((always_inline)) void attend_tile_dot(const uint32_t *q, float *acc, float *m, vfloat *l,
                                                                  const int32_t *pos, int rows, int32_t key0,
                                                                  const uint32_t *kt, const uint32_t *v, float scale,
                                                                  const int32_t d_len)
{
    int r = 0;
    while (r < rows && pos[r] < key0)
        r++;
    int32_t visible[ROW_GROUP];
    while (r < rows) {
        const int n = rows - r >= ROW_GROUP ? ROW_GROUP : 1;
        for (int i = 0; i < n; i++)
            visible[i] = pos[r + i] - key0 + 1;
        if (n == ROW_GROUP)
            attend_rows_dot(q + r * d_len / 2, acc + r * d_len, m + r, l + r, visible, kt, v, scale, d_len, ROW_GROUP);
        else
            attend_rows_dot(q + r * d_len / 2, acc + r * d_len, m + r, l + r, visible, kt, v, scale, d_len, 1);
        r += n;
    }
}

#endif

/* `dot`: bf16 on AVX512-BF16's dot products (HAVE_BF16_DOT, head_dim a multiple of 32), tiles of
 * KEY_TILE keys; otherwise float32 FMAs over blocks of KEY_BLOCK keys. */
static void run_item(const PagedArgs *a, const Item *item, float *scratch, const int bf16, const int dot)
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
    vfloat *lane_sums = (vfloat *)(s + MICRO_ROWS * KEY_BLOCK); /* the dot path's sums, lane by lane */
    float *sums = (float *)(lane_sums + rows), *m = sums + rows;
    int32_t *pos = (int32_t *)(m + rows);

    memset(acc, 0, sizeof(float) * rows * d_len);
    for (int r = 0; r < rows; r++) {
        m[r] = MASKED;
        sums[r] = 0.0f;
        lane_sums[r] = (vfloat){0};
    }
    for (int r = 0; r < rows; r++) {
        const int32_t token = item->first + r / group, head = item->kv_head * group + r % group;
        pos[r] = seq_len - q_len + token;
        const int64_t at = (int64_t)(q_start + token) * a->q_stride_r + head * a->q_stride_h;
        if (dot) { /* the row's bf16 as they are, d_len / 2 pairs */
            memcpy((uint32_t *)q + r * d_len / 2, (const uint16_t *)a->q + at, sizeof(uint16_t) * d_len);
            continue;
        }
        for (int32_t d = 0; d < d_len; d += LANES) {
            const vfloat scaled = load_lanes(a->q, at + d, bf16) * a->scale;
            memcpy(q + r * d_len + d, &scaled, sizeof scaled);
        }
    }

    const int32_t num_keys = pos[rows - 1] + 1;
#if HAVE_BF16_DOT
    if (dot) {
        for (int32_t key0 = 0; key0 < num_keys; key0 += KEY_TILE) {
            const int32_t count = num_keys - key0 < KEY_TILE ? num_keys - key0 : KEY_TILE;
            load_tile_pairs(a, table, item->kv_head, key0, count, (uint32_t *)kt, (uint32_t *)v);
            const uint32_t *qp = (const uint32_t *)q, *kp = (const uint32_t *)kt, *vp = (const uint32_t *)v;
            if (d_len == 64)
                attend_tile_dot(qp, acc, m, lane_sums, pos, rows, key0, kp, vp, a->scale, 64);
            else
                attend_tile_dot(qp, acc, m, lane_sums, pos, rows, key0, kp, vp, a->scale, d_len);
        }
        for (int r = 0; r < rows; r++)
            sums[r] = sum_of_lanes(lane_sums[r]);
    }
#endif
    if (!dot)
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
 * values, MICRO_ROWS rows of scores, each row's sums (a vector and a float), max and position. */
static size_t item_scratch_floats(int64_t max_rows, int32_t head_dim)
{
    return (size_t)(2 * max_rows * head_dim + 2 * KEY_BLOCK * head_dim + MICRO_ROWS * KEY_BLOCK + (LANES + 3) * max_rows);
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
    const int64_t max_rows = (int64_t)ITEM_TOKENS * (num_heads / num_kv_heads);
    const size_t scratch_floats = item_scratch_floats(max_rows, head_dim);
    const int dot = paged_prefill_attention_uses_bf16_dot(head_dim, dtype, kv);
    int failed = 0;
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
                run_item(&a, &items[k], scratch, dtype == 1, dot);
        }
        free(scratch);
    }
    free(items);
    return failed;
}
