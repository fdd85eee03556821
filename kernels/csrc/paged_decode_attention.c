/* Decode attention over a paged KV cache, for the CPU, reading the cache blocks in place.
 *
 * The PyTorch reference gathers every request's blocks into a contiguous copy before
 * scaled_dot_product_attention reads it again; at batch 64 that copy is a quarter of a
 * decode step. Here each work item walks its request's block table once for the keys and
 * once for the values, so the cache is read twice and written never.
 *
 * q and out are both float32 or both bfloat16; the arithmetic is float32 either way (a bf16
 * value is the top half of a float32, so widening it is a shift), and bf16 output is rounded
 * to nearest even once at the end. The cache is in any format of lanes.h (KV_*): float32 is
 * read in place, the others widened a tile at a time (8-bit rows times their scale). Softmax is two-pass (scores, then
 * max/exp/sum), as in the reference. A work item is one (request, kv head), or a request's
 * every kv head where there are at least ITEMS_PER_THREAD requests a thread: the heads of a
 * token are adjacent in a block, so such an item reads each block front to back, which the
 * hardware prefetcher follows (batch 32 x 1024 tokens on 2 Zen 3 cores: 3.2 -> 2.7 ms). The
 * query heads of a GQA group share each tile of 16 keys and values, widened to float32 once.
 *
 * The arithmetic is written with GCC vector extensions rather than hoping the compiler
 * vectorises scalar loops (it did not: a scores loop stayed scalar), LANES floats wide: 16
 * (one register) with AVX-512, else 8 (one AVX2 register, two NEON ones). A fixed 16 was 3
 * to 4.5x slower on AVX2, where each vector is two of its 16 registers: the scores loop's 16
 * key accumulators and query row took 40 and spilled. The scores loop keeps LANES accumulators,
 * one per key, against one query vector at a time, and sums them across lanes together by a
 * shuffle tree instead of one horizontal sum per key; the values loop keeps up to 8 output
 * vectors. Each tile's successor is prefetched a line at a time beside the tile's own loads
 * (see attend). head_dim must be a multiple of 16 and at most 256; 64 and 128 get copies
 * with the size known to the compiler. On CPUs with AMX, bf16 with head_dim 32 or 64 runs on
 * the tile unit instead (attend_amx, below); on CPUs with AVX512-BF16 but no AMX, bf16 with
 * head_dim a multiple of 32 runs on its dot products (attend_dot, below). Built and loaded by
 * kernels/cpu_attention.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "lanes.h"
#include "paged_args.h"

#define TILE 16
#define MAX_HEAD_DIM 256
/* accumulators of one output chunk: half the register file on AVX2, a quarter on AVX-512 */
#define OUT_VECS 8
/* work items per thread below which a request's kv heads are split into items of their own */
#define ITEMS_PER_THREAD 4


/* One round of the shuffle tree: a[k] = lo(a[2k], a[2k+1]) + hi(a[2k], a[2k+1]) for k < pairs,
 * the masks picking the two halves of every segment. */
static inline __attribute__((always_inline)) void fold(vfloat *a, int pairs, vint lo, vint hi)
{
    for (int k = 0; k < pairs; k++)
        a[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], lo) + __builtin_shuffle(a[2 * k], a[2 * k + 1], hi);
}

/* r[i] = the sum of the lanes of a[i], all LANES of them summed together by a shuffle tree
 * instead of one horizontal sum each. */
static inline __attribute__((always_inline)) vfloat sum_lanes_of_each(vfloat a[LANES])
{
#if LANES == 16
    /* halves first: AVX-512 permutes across its 128-bit lanes in one instruction */
    const vint lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vint hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vint lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vint hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vint lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vint hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vint lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vint hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    fold(a, 8, lo8, hi8);
    fold(a, 4, lo4, hi4);
    fold(a, 2, lo2, hi2);
    fold(a, 1, lo1, hi1);
#else
    /* pairs within each 128-bit half first (one vshufps each, as vhaddps does), the one
     * permute across the halves last: 21 operations for 8 sums */
    const vint even = {0, 2, 8, 10, 4, 6, 12, 14};
    const vint odd = {1, 3, 9, 11, 5, 7, 13, 15};
    const vint lo4 = {0, 1, 2, 3, 8, 9, 10, 11};
    const vint hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    fold(a, 4, even, odd);
    fold(a, 2, even, odd);
    fold(a, 1, lo4, hi4);
#endif
    return a[0];
}

/* Where tile (blk, off) of the request's block table starts in a cache, for kv head g, in
 * elements. */
static inline __attribute__((always_inline)) int64_t tile_at(
    const int32_t *table, int32_t blk, int32_t off, int64_t stride_b, int64_t stride_t, int64_t stride_h, int32_t g)
{
    return (int64_t)table[blk] * stride_b + g * stride_h + off * stride_t;
}

/* The float32 rows of the tile at `here` in `cache` (in its elements): the cache itself in
 * float32; in any other format, its n rows widened (and scaled) into `scratch` [TILE,
 * head_dim] once, so the query heads of the group do not each widen them again. The tile at
 * `next` is asked for as this one is read (see attend). */
static inline __attribute__((always_inline)) const float *tile_rows(
    const void *cache, int64_t here, int64_t next, int64_t stride_t, int32_t n, const int head_dim, const int kv,
    float *restrict scratch, int64_t *row_stride)
{
    if (kv == KV_F32) {
        *row_stride = stride_t;
        return (const float *)cache + here;
    }
    const int size = kv_size(kv);
    for (int32_t i = 0; i < n; i++) {
        const uint8_t *row = (const uint8_t *)cache + (here + i * stride_t) * size;
        const uint8_t *ahead = (const uint8_t *)cache + (next + i * stride_t) * size;
        const float scale = kv_row_scale(row, head_dim, kv);
        for (int c = 0; c < head_dim; c += LANES) {
            if (c * size % 64 == 0)
                __builtin_prefetch(ahead + c * size, 0, 1);
            store_lanes(scratch, (int64_t)i * head_dim + c, load_kv_lanes(row, c, kv) * scale, 0);
        }
    }
    *row_stride = head_dim;
    return scratch;
}

/* The float32 rows of kv head g's tile at (blk, off) of a cache (see tile_rows), with the
 * next tile's position there, (nblk, noff), in `*next_rows`: float32 rows to prefetch, or NULL
 * in other formats, where tile_rows prefetches them as it widens. */
static inline __attribute__((always_inline)) const float *head_tile(
    const void *cache, int64_t stride_b, int64_t stride_t, int64_t stride_h, const int32_t *table, int32_t blk,
    int32_t off, int32_t nblk, int32_t noff, int32_t g, int32_t n, const int head_dim, const int kv,
    float *restrict scratch, int64_t *row_stride, const float **next_rows)
{
    const int64_t next = tile_at(table, nblk, noff, stride_b, stride_t, stride_h, g);
    *next_rows = kv != KV_F32 ? NULL : (const float *)cache + next;
    return tile_rows(cache, tile_at(table, blk, off, stride_b, stride_t, stride_h, g), next, stride_t, n, head_dim,
                     kv, scratch, row_stride);
}

/* (blk, off) moved on to the next tile of the block table. */
static inline __attribute__((always_inline)) void next_tile(int32_t *blk, int32_t *off, int32_t bs)
{
    *off += TILE;
    if (*off == bs) {
        *off = 0;
        *blk += 1;
    }
}

/* Each of `rows` rows of scores (s_stride apart), its first len entries, turned into
 * probabilities in place. */
static inline __attribute__((always_inline)) void softmax_rows(float *scores, int64_t s_stride, int rows, int32_t len)
{
    for (int j = 0; j < rows; j++) {
        float *restrict s = scores + j * s_stride;
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
}

/* kv heads g0 .. g0+ng-1 of request r; q and out in bf16 where `bf16`, the cache in format kv. Scratch: q_f32 and acc [ng * group, head_dim], scores
 * [ng * group, s_stride], tile [TILE, head_dim].
 *
 * The next tile lies wherever the block table says, where no hardware prefetcher looks, so
 * its rows are asked for while this tile is worked on: one prefetch per cache line, beside
 * the first query head's load from the same place in this tile (in bf16, beside the
 * widening). Spread out like that they keep the memory busy while the arithmetic runs (batch
 * 32 x 1024 tokens on 2 Zen 3 cores: 3.1 -> 2.7 ms); a tile's prefetches all issued at once
 * before its arithmetic gained nothing there. They fill L2, not L1 (locality 1): asked into
 * L1, a layer of batch 32 x 512 tokens in float32 with the cache out of L3 took 1.64 ms on 2
 * Zen 4 cores, into L2 1.07 ms. On the last tile `next` is the tile itself. */
static inline __attribute__((always_inline)) void attend(
    const PagedArgs *a, int32_t r, int32_t g0, int32_t ng, const int head_dim, const int bf16, const int kv,
    float *restrict q_f32, float *restrict scores, int64_t s_stride, float *restrict acc, float *restrict tile)
{
    const int group = a->num_heads / a->num_kv_heads;
    const int32_t len = a->seq_lens[r];
    const int32_t bs = a->block_size;
    const int32_t *table = a->block_tables + r * a->bt_stride;
    const int64_t q_base = r * a->q_stride_r + (int64_t)g0 * group * a->q_stride_h;
    const int chunks = head_dim / LANES;
    /* a prefetch goes beside every vecs_per_line-th load, the first of each cache line */
    const int vecs_per_line = 64 / (int)sizeof(vfloat);
    int64_t stride;

    /* fold the scale into the query: one multiply per element instead of one per score */
    for (int j = 0; j < ng * group; j++)
        for (int c = 0; c < head_dim; c += LANES)
            store_lanes(q_f32, j * head_dim + c, load_lanes(a->q, q_base + j * a->q_stride_h + c, bf16) * a->scale, 0);

    /* TILE keys at a time; a tile never straddles a block, whose size is a multiple of TILE */
    for (int32_t t0 = 0, blk = 0, off = 0; t0 < len; t0 += TILE) {
        const int32_t n = len - t0 < TILE ? len - t0 : TILE;
        int32_t nblk = blk, noff = off;
        if (t0 + TILE < len)
            next_tile(&nblk, &noff, bs);
        for (int32_t g = g0; g < g0 + ng; g++) {
            const float *k_next;
            const float *k = head_tile(a->k_cache, a->kc_stride_b, a->kc_stride_t, a->kc_stride_h, table, blk, off, nblk,
                                       noff, g, n, head_dim, kv, tile, &stride, &k_next);
            const int first = (g - g0) * group;
            for (int i0 = 0; i0 < TILE; i0 += LANES) {
                /* keys past the end read the last real one, whose scores are then dropped */
                const float *rows[LANES];
                for (int i = 0; i < LANES; i++)
                    rows[i] = k + (i0 + i < n ? i0 + i : n - 1) * stride;
                for (int j = first; j < first + group; j++) {
                    /* one accumulator per key and the query one vector at a time: on AVX2 a
                     * whole query row beside the accumulators would not fit in 16 registers */
                    vfloat partial[LANES] = {0};
                    for (int c = 0; c < chunks; c++) {
                        const vfloat qc = load_lanes(q_f32, j * head_dim + c * LANES, 0);
                        if (kv == KV_F32 && j == first && c % vecs_per_line == 0)
                            for (int i = 0; i < LANES; i++)
                                __builtin_prefetch(k_next + (i0 + i) * a->kc_stride_t + c * LANES, 0, 1);
                        for (int i = 0; i < LANES; i++)
                            partial[i] += qc * load_lanes(rows[i], c * LANES, 0);
                    }
                    const vfloat sum = sum_lanes_of_each(partial);
                    memcpy(scores + j * s_stride + t0 + i0, &sum, sizeof sum);
                }
            }
        }
        blk = nblk;
        off = noff;
    }

    softmax_rows(scores, s_stride, ng * group, len);

    memset(acc, 0, sizeof(float) * (size_t)(ng * group) * (size_t)head_dim);
    for (int32_t t0 = 0, blk = 0, off = 0; t0 < len; t0 += TILE) {
        const int32_t n = len - t0 < TILE ? len - t0 : TILE;
        int32_t nblk = blk, noff = off;
        if (t0 + TILE < len)
            next_tile(&nblk, &noff, bs);
        for (int32_t g = g0; g < g0 + ng; g++) {
            const float *v_next;
            const float *v = head_tile(a->v_cache, a->vc_stride_b, a->vc_stride_t, a->vc_stride_h, table, blk, off, nblk,
                                       noff, g, n, head_dim, kv, tile, &stride, &v_next);
            const int first = (g - g0) * group;
            for (int j = first; j < first + group; j++) {
                const float *p = scores + j * s_stride + t0;
                /* OUT_VECS accumulators at a time, so that on AVX2 a 128-wide row does not spill */
                for (int c0 = 0; c0 < chunks; c0 += OUT_VECS) {
                    const int m = chunks - c0 < OUT_VECS ? chunks - c0 : OUT_VECS;
                    vfloat o[OUT_VECS];
                    for (int c = 0; c < m; c++)
                        o[c] = load_lanes(acc, j * head_dim + (c0 + c) * LANES, 0);
                    for (int32_t i = 0; i < n; i++)
                        for (int c = 0; c < m; c++) {
                            if (kv == KV_F32 && j == first && (c0 + c) % vecs_per_line == 0)
                                __builtin_prefetch(v_next + i * a->vc_stride_t + (c0 + c) * LANES, 0, 1);
                            o[c] += p[i] * load_lanes(v, i * stride + (c0 + c) * LANES, 0);
                        }
                    for (int c = 0; c < m; c++)
                        store_lanes(acc, j * head_dim + (c0 + c) * LANES, o[c], 0);
                }
            }
        }
        blk = nblk;
        off = noff;
    }

    for (int j = 0; j < ng * group; j++) {
        const int64_t out = r * a->out_stride_r + ((int64_t)g0 * group + j) * a->out_stride_h;
        for (int c = 0; c < head_dim; c += LANES)
            store_lanes(a->out, out + c, load_lanes(acc, j * head_dim + c, 0), bf16);
    }
}

/* Ask for the bf16 rows of kv head g's tile after the one at key t0, if the request has one,
 * all at once, into the cache level `locality` names (__builtin_prefetch's: 3 for L1, 1 for
 * L2): the block table sends each tile somewhere no hardware prefetcher looks. */
static inline __attribute__((always_inline)) void prefetch_tile(
    const uint16_t *cache, int64_t stride_b, int64_t stride_t, int64_t stride_h, const int32_t *table, int32_t bs,
    int32_t t0, int32_t len, int32_t g, int head_dim, const int locality)
{
    const int32_t at = t0 + TILE;
    if (at >= len)
        return;
    const uint16_t *rows = cache + tile_at(table, at / bs, at % bs, stride_b, stride_t, stride_h, g);
    const int32_t n = len - at < TILE ? len - at : TILE;
    for (int32_t i = 0; i < n; i++)
        for (int d = 0; d < head_dim; d += 32)
            __builtin_prefetch(rows + i * stride_t + d, 0, locality);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
/* ---- bfloat16 on AMX ---------------------------------------------------------------------
 *
 * On CPUs with AMX (Intel Sapphire Rapids and later) the arithmetic of a bf16 decode step
 * goes to the tile unit, which turns the kernel from bound by vector arithmetic (about 8 GB/s
 * of cache read per core, even with everything in L2) into one bound by memory:
 *
 *   scores^T [16 keys, group] = K tile [16 keys, head_dim] x q^T [head_dim, group]: the key
 *   rows go into the tile unit straight from the cache block (a strided tile load), the query
 *   heads of the group once per item, re-laid as pairs of dims (AMX's VNNI layout);
 *
 *   out [group, head_dim] += P [group, 16 keys] x V tile [16 keys, head_dim]: here the values
 *   are the pairs operand, so each tile's rows are interleaved two keys at a time
 *   (vpunpck{l,h}wd, which leave the dims permuted within each 128-bit lane; the output is
 *   put back in order once at the end). P is split into a bf16 part and a bf16 remainder,
 *   both multiplied, so the probabilities keep 16 bits rather than bf16's 8 and the output
 *   stays within float32 rounding of the exact result, as the vector path's.
 *
 * Products of bf16 are exact in float32 and accumulate in float32, so the result is the
 * vector path's to float rounding. head_dim 32 or 64 (up to 4 output tiles of 16 floats),
 * at most 16 query heads per kv head. The tile configuration of the calling thread (oneDNN
 * and PyTorch use the tile unit between our calls) is saved on entry and restored on exit.
 */
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_MAX_GROUP 16

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Whether this process may use the tile unit: Linux grants it on request, once per process. */
static int amx_permitted(void)
{
    static int state = -1;
    if (state < 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

static int amx_takes(int dtype, int kv, int head_dim, int group, int block_size)
{
    return dtype != 0 && kv == KV_BF16 && (head_dim == 32 || head_dim == 64) && group <= AMX_MAX_GROUP && block_size % TILE == 0 &&
           amx_permitted();
}

static void set_tile(TileConfig *c, int tmm, int rows, int colsb)
{
    c->rows[tmm] = (uint8_t)rows;
    c->colsb[tmm] = (uint16_t)colsb;
}

/* The bf16 bits of a float32 vector, rounded to nearest even (no NaN reaches here). */
static inline __attribute__((always_inline)) __m256i bf16_of(__m512 v)
{
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                         _mm512_set1_epi32(1))));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

/* Tiles: scores pass 0 = scores^T, 1 = key rows, 2 = query pairs; values pass 0-3 = output
 * (16 dims each), 4 = P's bf16 part, 5 = its remainder, 6 = value pairs. */
static void attend_amx(const PagedArgs *a, int32_t r, int32_t g0, int32_t ng, float *restrict scores,
                       int64_t s_stride)
{
    const int group = a->num_heads / a->num_kv_heads;
    const int hd = a->head_dim, chunks = hd / 32;
    const int32_t len = a->seq_lens[r], bs = a->block_size;
    const int32_t *table = a->block_tables + r * a->bt_stride;
    const uint16_t *q = a->q, *k_cache = a->k_cache, *v_cache = a->v_cache;
    uint16_t q_pairs[2][16][AMX_MAX_GROUP][2] __attribute__((aligned(64)));
    uint16_t v_pairs[4][8][32] __attribute__((aligned(64)));
    uint16_t p_hi[AMX_MAX_GROUP][16] __attribute__((aligned(64))), p_lo[AMX_MAX_GROUP][16] __attribute__((aligned(64)));
    float st[16][AMX_MAX_GROUP] __attribute__((aligned(64)));
    float o[4][AMX_MAX_GROUP][16] __attribute__((aligned(64)));

    TileConfig scores_cfg = {.palette_id = 1}, values_cfg = {.palette_id = 1};
    set_tile(&scores_cfg, 0, 16, group * 4);
    set_tile(&scores_cfg, 1, 16, 64);
    set_tile(&scores_cfg, 2, 16, group * 4);
    for (int t = 0; t < 2 * chunks; t++)
        set_tile(&values_cfg, t, group, 64);
    set_tile(&values_cfg, 4, group, 32);
    set_tile(&values_cfg, 5, group, 32);
    set_tile(&values_cfg, 6, 8, 64);

    _tile_loadconfig(&scores_cfg);
    for (int32_t g = g0; g < g0 + ng; g++) {
        const int first = (g - g0) * group;
        for (int j = 0; j < group; j++) {
            const uint16_t *qj = q + r * a->q_stride_r + (int64_t)(g * group + j) * a->q_stride_h;
            for (int c = 0; c < chunks; c++)
                for (int p = 0; p < 16; p++) {
                    q_pairs[c][p][j][0] = qj[32 * c + 2 * p];
                    q_pairs[c][p][j][1] = qj[32 * c + 2 * p + 1];
                }
        }
        for (int32_t t0 = 0, blk = 0, off = 0; t0 < len; t0 += TILE) {
            const int32_t n = len - t0 < TILE ? len - t0 : TILE;
            /* rows past len are other slots of the same block: their scores are not read */
            const uint16_t *k = k_cache + tile_at(table, blk, off, a->kc_stride_b, a->kc_stride_t, a->kc_stride_h, g);
            prefetch_tile(k_cache, a->kc_stride_b, a->kc_stride_t, a->kc_stride_h, table, bs, t0, len, g, hd, 3);
            _tile_zero(0);
            for (int c = 0; c < chunks; c++) {
                _tile_loadd(1, k + 32 * c, a->kc_stride_t * 2);
                _tile_loadd(2, q_pairs[c], AMX_MAX_GROUP * 4);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, st, AMX_MAX_GROUP * 4);
            for (int j = 0; j < group; j++)
                for (int32_t i = 0; i < n; i++)
                    scores[(first + j) * s_stride + t0 + i] = st[i][j] * a->scale;
            next_tile(&blk, &off, bs);
        }
    }

    softmax_rows(scores, s_stride, ng * group, len);

    _tile_loadconfig(&values_cfg);
    for (int32_t g = g0; g < g0 + ng; g++) {
        const int first = (g - g0) * group;
        for (int t = 0; t < 2 * chunks; t++)
            switch (t) {
            case 0: _tile_zero(0); break;
            case 1: _tile_zero(1); break;
            case 2: _tile_zero(2); break;
            default: _tile_zero(3); break;
            }
        for (int32_t t0 = 0, blk = 0, off = 0; t0 < len; t0 += TILE) {
            const int32_t n = len - t0 < TILE ? len - t0 : TILE;
            const uint16_t *v = v_cache + tile_at(table, blk, off, a->vc_stride_b, a->vc_stride_t, a->vc_stride_h, g);
            prefetch_tile(v_cache, a->vc_stride_b, a->vc_stride_t, a->vc_stride_h, table, bs, t0, len, g, hd, 3);
            /* keys 2i and 2i+1 interleaved; keys past len as zeros, so that whatever their
             * slots hold cannot reach the output through a zero probability (0 * inf) */
            for (int i = 0; i < 8; i++)
                for (int c = 0; c < chunks; c++) {
                    const __m512i even = 2 * i < n ? _mm512_loadu_si512(v + 2 * i * a->vc_stride_t + 32 * c)
                                                   : _mm512_setzero_si512();
                    const __m512i odd = 2 * i + 1 < n ? _mm512_loadu_si512(v + (2 * i + 1) * a->vc_stride_t + 32 * c)
                                                      : _mm512_setzero_si512();
                    _mm512_store_si512(v_pairs[2 * c][i], _mm512_unpacklo_epi16(even, odd));
                    _mm512_store_si512(v_pairs[2 * c + 1][i], _mm512_unpackhi_epi16(even, odd));
                }
            const __mmask16 valid = (__mmask16)((1u << n) - 1u);
            for (int j = 0; j < group; j++) {
                const __m512 p = _mm512_maskz_loadu_ps(valid, scores + (first + j) * s_stride + t0);
                const __m256i hi = bf16_of(p);
                const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
                _mm256_store_si256((__m256i *)p_hi[j], hi);
                _mm256_store_si256((__m256i *)p_lo[j], bf16_of(_mm512_sub_ps(p, hi_f)));
            }
            _tile_loadd(4, p_hi, 32);
            _tile_loadd(5, p_lo, 32);
#define ACCUMULATE(t)                                   \
    _tile_loadd(6, v_pairs[t], 64);                     \
    _tile_dpbf16ps(t, 4, 6);                            \
    _tile_dpbf16ps(t, 5, 6)
            ACCUMULATE(0);
            ACCUMULATE(1);
            if (chunks == 2) {
                ACCUMULATE(2);
                ACCUMULATE(3);
            }
#undef ACCUMULATE
            next_tile(&blk, &off, bs);
        }
        _tile_stored(0, o[0], 64);
        _tile_stored(1, o[1], 64);
        if (chunks == 2) {
            _tile_stored(2, o[2], 64);
            _tile_stored(3, o[3], 64);
        }
        /* column m of output tile 2c+h holds dim 32c + 8 (m / 4) + 4h + m % 4 (see above) */
        for (int j = 0; j < group; j++) {
            float row[64] __attribute__((aligned(64)));
            for (int t = 0; t < 2 * chunks; t++)
                for (int m = 0; m < 16; m++)
                    row[32 * (t / 2) + 8 * (m / 4) + 4 * (t % 2) + m % 4] = o[t][j][m];
            const int64_t out = r * a->out_stride_r + ((int64_t)g * group + j) * a->out_stride_h;
            for (int d = 0; d < hd; d += LANES)
                store_lanes(a->out, out + d, load_lanes(row, d, 0), 1);
        }
    }
}
#else
static int amx_takes(int dtype, int kv, int head_dim, int group, int block_size)
{
    (void)dtype, (void)kv, (void)head_dim, (void)group, (void)block_size;
    return 0;
}
#endif

#if defined(__AVX512BF16__) && LANES == 16
/* ---- bfloat16 on AVX512-BF16 dot products --------------------------------------------------
 *
 * Without AMX, a CPU with AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake) multiplies 16
 * pairs of bf16 and adds them into float32 in one instruction (vdpbf16ps), so the bf16 cache
 * is read as it lies instead of widened into float32 rows first, and each instruction does two
 * multiply-adds. The scores take each key row as the pairs operand against the query row, 16
 * keys' partial sums then summed across lanes together by the shuffle tree, as the vector path
 * does. The values are interleaved two keys at a time (vpunpck{l,h}wd, which permute the dims
 * within each 128-bit lane, put back in order once at the end, as on AMX) and multiplied by
 * pairs of probabilities, each split into a bf16 part and a bf16 remainder, so the
 * probabilities keep 16 bits and the output is the float32 result rounded, as the vector path's.
 * The next tile's rows are asked for all at once (prefetch_tile), into L2. Measured on a
 * 2-core Zen 4, bf16, batch 32 x 512 tokens, 9 query heads on 3 kv heads, a layer with its
 * blocks scattered and out of L3: 1.40 -> 1.01 ms on one core and 0.83 -> 0.57 ms on two
 * against the widening path (attend) with its prefetches into L2; into L1, the tiles here took
 * 1.9 ms on one core.
 */
#include <immintrin.h>

#define DOT_MAX_CHUNKS (MAX_HEAD_DIM / 32)

static int dot_takes(int dtype, int kv, int head_dim)
{
    return dtype != 0 && kv == KV_BF16 && head_dim % 32 == 0;
}

/* kv heads g0 .. g0+ng-1 of request r, as attend (q, out and the cache in bf16). Scratch:
 * acc [ng * group, head_dim] (in the interleaved order until the end), scores [ng * group,
 * s_stride]. */
static inline __attribute__((always_inline)) void attend_dot(const PagedArgs *a, int32_t r, int32_t g0, int32_t ng,
                                                             const int head_dim, float *restrict scores,
                                                             int64_t s_stride, float *restrict acc)
{
    const int group = a->num_heads / a->num_kv_heads, chunks = head_dim / 32;
    const int32_t len = a->seq_lens[r], bs = a->block_size;
    const int32_t *table = a->block_tables + r * a->bt_stride;
    const uint16_t *q = (const uint16_t *)a->q + r * a->q_stride_r + (int64_t)g0 * group * a->q_stride_h;
    const uint16_t *k_cache = a->k_cache, *v_cache = a->v_cache;
    const int64_t kst = a->kc_stride_t, vst = a->vc_stride_t;
    /* value pairs [output vector][key pair][16 dwords]: dims permuted as vpunpck{l,h}wd leave them */
    __m512i v_pairs[2 * DOT_MAX_CHUNKS][TILE / 2];

    for (int32_t t0 = 0, blk = 0, off = 0; t0 < len; t0 += TILE, next_tile(&blk, &off, bs)) {
        const int32_t n = len - t0 < TILE ? len - t0 : TILE;
        for (int32_t g = g0; g < g0 + ng; g++) {
            const uint16_t *k = k_cache + tile_at(table, blk, off, a->kc_stride_b, kst, a->kc_stride_h, g);
            const int first = (g - g0) * group;
            prefetch_tile(k_cache, a->kc_stride_b, kst, a->kc_stride_h, table, bs, t0, len, g, head_dim, 1);
            for (int j = first; j < first + group; j++) {
                __m512bh qv[DOT_MAX_CHUNKS];
                for (int c = 0; c < chunks; c++)
                    qv[c] = (__m512bh)_mm512_loadu_si512(q + j * a->q_stride_h + 32 * c);
                vfloat partial[LANES];
                for (int i = 0; i < TILE; i++) {
                    /* keys past the end read the last real one, whose scores are then dropped */
                    const uint16_t *row = k + (i < n ? i : n - 1) * kst;
                    __m512 s = _mm512_setzero_ps();
                    for (int c = 0; c < chunks; c++)
                        s = _mm512_dpbf16_ps(s, qv[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
                    memcpy(&partial[i], &s, sizeof s);
                }
                const vfloat sum = sum_lanes_of_each(partial) * a->scale;
                memcpy(scores + j * s_stride + t0, &sum, sizeof sum);
            }
        }
    }

    softmax_rows(scores, s_stride, ng * group, len);

    memset(acc, 0, sizeof(float) * (size_t)(ng * group) * (size_t)head_dim);
    for (int32_t t0 = 0, blk = 0, off = 0; t0 < len; t0 += TILE, next_tile(&blk, &off, bs)) {
        const int32_t n = len - t0 < TILE ? len - t0 : TILE;
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        for (int32_t g = g0; g < g0 + ng; g++) {
            const uint16_t *v = v_cache + tile_at(table, blk, off, a->vc_stride_b, vst, a->vc_stride_h, g);
            prefetch_tile(v_cache, a->vc_stride_b, vst, a->vc_stride_h, table, bs, t0, len, g, head_dim, 1);
            /* keys past the end as zeros, so that whatever their slots hold cannot reach the
             * output through a zero probability (0 * inf) */
            for (int i = 0; i < TILE / 2; i++)
                for (int c = 0; c < chunks; c++) {
                    const __m512i even = 2 * i < n ? _mm512_loadu_si512(v + 2 * i * vst + 32 * c) : _mm512_setzero_si512();
                    const __m512i odd =
                        2 * i + 1 < n ? _mm512_loadu_si512(v + (2 * i + 1) * vst + 32 * c) : _mm512_setzero_si512();
                    v_pairs[2 * c][i] = _mm512_unpacklo_epi16(even, odd);
                    v_pairs[2 * c + 1][i] = _mm512_unpackhi_epi16(even, odd);
                }
            const int first = (g - g0) * group;
            for (int j = first; j < first + group; j++) {
                const __m512 p = _mm512_maskz_loadu_ps(valid, scores + j * s_stride + t0);
                const __m256bh hi = _mm512_cvtneps_pbh(p);
                const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)hi), 16));
                const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(p, hi_f));
                uint32_t hi_pairs[TILE / 2] __attribute__((aligned(32))), lo_pairs[TILE / 2] __attribute__((aligned(32)));
                _mm256_store_si256((__m256i *)hi_pairs, (__m256i)hi);
                _mm256_store_si256((__m256i *)lo_pairs, (__m256i)lo);
                /* the bf16 parts and the remainders in accumulators of their own: twice the
                 * chains, to keep the dot products' latency hidden */
                __m512 o_hi[2 * DOT_MAX_CHUNKS], o_lo[2 * DOT_MAX_CHUNKS];
                for (int t = 0; t < 2 * chunks; t++) {
                    o_hi[t] = _mm512_loadu_ps(acc + j * head_dim + 16 * t);
                    o_lo[t] = _mm512_setzero_ps();
                }
                for (int i = 0; i < TILE / 2; i++) {
                    const __m512bh h = (__m512bh)_mm512_set1_epi32((int)hi_pairs[i]);
                    const __m512bh l = (__m512bh)_mm512_set1_epi32((int)lo_pairs[i]);
                    for (int t = 0; t < 2 * chunks; t++) {
                        o_hi[t] = _mm512_dpbf16_ps(o_hi[t], h, (__m512bh)v_pairs[t][i]);
                        o_lo[t] = _mm512_dpbf16_ps(o_lo[t], l, (__m512bh)v_pairs[t][i]);
                    }
                }
                for (int t = 0; t < 2 * chunks; t++)
                    _mm512_storeu_ps(acc + j * head_dim + 16 * t, _mm512_add_ps(o_hi[t], o_lo[t]));
            }
        }
    }

    /* dim 32c + 8 (m / 4) + 4h + m % 4 sits in lane m of output vector 2c + h (see above) */
    const vint first_half = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    const vint second_half = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    for (int j = 0; j < ng * group; j++) {
        const int64_t out = r * a->out_stride_r + ((int64_t)g0 * group + j) * a->out_stride_h;
        for (int c = 0; c < chunks; c++) {
            const vfloat lo = load_lanes(acc, j * head_dim + 32 * c, 0), hi = load_lanes(acc, j * head_dim + 32 * c + 16, 0);
            store_lanes(a->out, out + 32 * c, __builtin_shuffle(lo, hi, first_half), 1);
            store_lanes(a->out, out + 32 * c + 16, __builtin_shuffle(lo, hi, second_half), 1);
        }
    }
}

#define SPECIALISE_DOT(name, head_dim)                                                                       \
    static void name(const PagedArgs *a, int32_t r, int32_t g0, int32_t ng, float *scores, int64_t s_stride, \
                     float *acc)                                                                             \
    {                                                                                                        \
        attend_dot(a, r, g0, ng, head_dim, scores, s_stride, acc);                                           \
    }
typedef void (*DotFn)(const PagedArgs *, int32_t, int32_t, int32_t, float *, int64_t, float *);
SPECIALISE_DOT(attend_dot_64, 64)
SPECIALISE_DOT(attend_dot_128, 128)
SPECIALISE_DOT(attend_dot_any, a->head_dim)
#else
static int dot_takes(int dtype, int kv, int head_dim)
{
    (void)dtype, (void)kv, (void)head_dim;
    return 0;
}
#endif

/* Whether a call with these arguments runs on AMX (see above): 1 or 0. */
int paged_decode_attention_uses_amx(int32_t head_dim, int32_t num_heads, int32_t num_kv_heads, int32_t block_size,
                                    int32_t dtype, int32_t kv)
{
    return amx_takes(dtype, kv, head_dim, num_heads / num_kv_heads, block_size);
}

/* Whether a call with these arguments runs on AVX512-BF16's dot products (see above): 1 or 0. */
int paged_decode_attention_uses_bf16_dot(int32_t head_dim, int32_t num_heads, int32_t num_kv_heads,
                                         int32_t block_size, int32_t dtype, int32_t kv)
{
    return !amx_takes(dtype, kv, head_dim, num_heads / num_kv_heads, block_size) && dot_takes(dtype, kv, head_dim);
}

typedef void (*AttendFn)(const PagedArgs *, int32_t, int32_t, int32_t, float *, float *, int64_t, float *, float *);

#define SPECIALISE(name, head_dim, bf16, kv)                                                               \
    static void name(const PagedArgs *a, int32_t r, int32_t g0, int32_t ng, float *q_f32, float *scores, \
                     int64_t s_stride, float *acc, float *tile)                                            \
    {                                                                                                      \
        attend(a, r, g0, ng, head_dim, bf16, kv, q_f32, scores, s_stride, acc, tile);                      \
    }
/* q, out and cache in one dtype, then a cache in another format (known at run time) */
SPECIALISE(attend_f32_64, 64, 0, KV_F32)
SPECIALISE(attend_f32_128, 128, 0, KV_F32)
SPECIALISE(attend_f32_any, a->head_dim, 0, KV_F32)
SPECIALISE(attend_bf16_64, 64, 1, KV_BF16)
SPECIALISE(attend_bf16_128, 128, 1, KV_BF16)
SPECIALISE(attend_bf16_any, a->head_dim, 1, KV_BF16)
SPECIALISE(attend_f32_kv_64, 64, 0, a->kv)
SPECIALISE(attend_f32_kv_128, 128, 0, a->kv)
SPECIALISE(attend_f32_kv_any, a->head_dim, 0, a->kv)
SPECIALISE(attend_bf16_kv_64, 64, 1, a->kv)
SPECIALISE(attend_bf16_kv_128, 128, 1, a->kv)
SPECIALISE(attend_bf16_kv_any, a->head_dim, 1, a->kv)

/* dtype (q and out) 0: float32, 1: bfloat16; kv: the cache's format (KV_*). Returns 0; 1 when a thread could not allocate its scratch
 * (nothing is then computed); 2 for a head_dim or block_size the kernel does not take; 3 when
 * a request has no token in the cache (nothing computed). The longest length is found here,
 * not by the caller: two reductions over a tensor cost the Python side more than this call's
 * work at batch 1. */
int paged_decode_attention(
    void *out, int64_t out_stride_r, int64_t out_stride_h,
    const void *q, int64_t q_stride_r, int64_t q_stride_h,
    const void *k_cache, int64_t kc_stride_b, int64_t kc_stride_t, int64_t kc_stride_h,
    const void *v_cache, int64_t vc_stride_b, int64_t vc_stride_t, int64_t vc_stride_h,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    int32_t num_reqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
    float scale, int32_t dtype, int32_t kv)
{
    if (head_dim % TILE != 0 || head_dim > MAX_HEAD_DIM || block_size % TILE != 0 || kv < KV_F32 || kv > KV_I8)
        return 2;
    int32_t max_seq_len = 0;
    for (int32_t r = 0; r < num_reqs; r++) {
        if (seq_lens[r] < 1)
            return 3;
        max_seq_len = seq_lens[r] > max_seq_len ? seq_lens[r] : max_seq_len;
    }
    const PagedArgs args = {
        out, out_stride_r, out_stride_h, q, q_stride_r, q_stride_h,
        k_cache, kc_stride_b, kc_stride_t, kc_stride_h, v_cache, vc_stride_b, vc_stride_t, vc_stride_h,
        block_tables, bt_stride, seq_lens, NULL, num_reqs, num_heads, num_kv_heads, head_dim, block_size,
        max_seq_len, scale, kv,
    };
    const AttendFn kernels[2][2][3] = {
        {{attend_f32_64, attend_f32_128, attend_f32_any}, {attend_f32_kv_64, attend_f32_kv_128, attend_f32_kv_any}},
        {{attend_bf16_64, attend_bf16_128, attend_bf16_any},
         {attend_bf16_kv_64, attend_bf16_kv_128, attend_bf16_kv_any}},
    };
    const int same = kv == (dtype != 0 ? KV_BF16 : KV_F32);
    const AttendFn kernel = kernels[dtype != 0][!same][head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2];
    const int amx = amx_takes(dtype, kv, head_dim, num_heads / num_kv_heads, block_size);
    const int dot = paged_decode_attention_uses_bf16_dot(head_dim, num_heads, num_kv_heads, block_size, dtype, kv);
    /* a request's kv heads in one work item where there are requests enough to go round: the
     * heads of a token sit side by side in a block, so the item then reads whole blocks front
     * to back, which the hardware prefetcher follows */
    const int32_t ng = num_reqs >= ITEMS_PER_THREAD * omp_get_max_threads() ? num_kv_heads : 1;
    const int32_t items_per_req = num_kv_heads / ng;
    const size_t heads = (size_t)(ng * (num_heads / num_kv_heads));
    /* whole tiles of scores, so a tile's are stored as one vector however many keys it has */
    const int64_t s_stride = (max_seq_len + TILE - 1) / TILE * TILE;
    int failed = 0;
#pragma omp parallel
    {
        float *q_f32 = malloc(sizeof(float) * heads * (size_t)head_dim);
        float *acc = malloc(sizeof(float) * heads * (size_t)head_dim);
        float *tile = malloc(sizeof(float) * TILE * (size_t)head_dim);
        float *scores = malloc(sizeof(float) * heads * (size_t)s_stride);
        if (q_f32 == NULL || acc == NULL || tile == NULL || scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed && amx) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
            TileConfig callers;
            _tile_storeconfig(&callers);
#pragma omp for schedule(dynamic, 1)
            for (int32_t item = 0; item < num_reqs * items_per_req; item++)
                attend_amx(&args, item / items_per_req, item % items_per_req * ng, ng, scores, s_stride);
            if (callers.palette_id != 0)
                _tile_loadconfig(&callers);
            else
                _tile_release();
#endif
        } else if (!failed && dot) {
#if defined(__AVX512BF16__) && LANES == 16
            const DotFn dot_kernel = head_dim == 64 ? attend_dot_64 : head_dim == 128 ? attend_dot_128 : attend_dot_any;
#pragma omp for schedule(dynamic, 1)
            for (int32_t item = 0; item < num_reqs * items_per_req; item++)
                dot_kernel(&args, item / items_per_req, item % items_per_req * ng, ng, scores, s_stride, acc);
#endif
        } else if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int32_t item = 0; item < num_reqs * items_per_req; item++)
                kernel(&args, item / items_per_req, item % items_per_req * ng, ng, q_f32, scores, s_stride, acc, tile);
        }
        free(q_f32);
        free(acc);
        free(tile);
        free(scores);
    }
    return failed;
}
