/* y = x W^T + b for a bfloat16 model on CPUs with AVX512-BF16, W kept in its GGUF block format
 * (Q4_1 or Q8_0), x and y bfloat16.
 *
 * A small decode step waits for the weights: oneDNN's bfloat16 product streams 2 bytes a weight,
 * where the blocks hold 0.6 (Q4_1) to 1.1 (Q8_0). Here each panel of PANEL rows of W is widened
 * once into a per-thread scratch of bfloat16, which every row of x then reads from cache. The
 * widening costs about as much as the bytes it saves on one core, and less on two, where
 * oneDNN's stream of bytes barely gets faster: on a 2-core Zen 4 the model's products took
 * 14-16 / 18-20 / 24-26 ms at 1 / 4 / 8 rows on one core against oneDNN's 20-22 / 18-20 / 23-24,
 * and 8.1 / 10.8 / 14.5 / 17.0 / 21.3 ms at 1 / 4 / 8 / 12 / 16 rows on two cores against
 * 15.5-15.8 / 13.7-14.0 / 15.6-15.9 / 18.5-20.3 / 19.9-21.3 (`python -m bench.linear_products
 * --dtype bfloat16`). In whole decode steps of 300-token requests (the engine alone, steps with
 * and without the kernel taken in turn, medians of 20) it gained less: on two cores 15.4 -> 13.4 ms
 * at 1 request, 21.3 -> 17.0 at 4, 23.9 -> 21.7 at 8 and nothing or worse from 12 on; on one core
 * 22.8 -> 19.3 at 1, 28.0 -> 25.1 at 3 and 26.7 -> 28.1 at 4, so shared/model/linear.py sends it
 * products of up to 8 rows, 3 on one thread. Widening the next panel in the gaps of the current
 * one's dot products did not change that beyond the noise, nor did tiles of 6 rows of x.
 *
 * The widened weights are bitwise the bfloat16 weights the loader makes: the float32 value is
 * d*q + m (Q4_1, d*q exact, one rounding, as a fused multiply-add makes it) or d*q (Q8_0,
 * exact), then rounded to nearest even by VCVTNE2PS2BF16 as torch rounds it (the values are
 * multiples of fp16's smallest step, so no float32 subnormal arises for its flushing to
 * matter). VDPBF16PS multiplies bfloat16 pairs exactly into float32 sums, as oneDNN's bfloat16
 * product does, so the result differs from it only in the order of the sums; the sum plus the
 * bias is rounded to bfloat16 once.
 *
 * Tiles of up to ROWS_X rows of x by GROUP rows of W keep ROWS_X * GROUP sums of 16 lanes along
 * K in registers (K is a multiple of the 32-wide block, one VDPBF16PS a block), which are added
 * across their lanes once at the end. Panels are split between torch's OpenMP threads, each
 * streaming a contiguous range of W. Without AVX512-BF16 the library builds but
 * `quantized_linear_bf16_available` says 0. Built and loaded by kernels/quantized_linear.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define FORMAT_Q4_1 0
#define FORMAT_Q8_0 1
#define Q4_1_BYTES 20 /* fp16 d, fp16 m, 16 bytes of nibbles: low nibbles are elements 0-15 */
#define Q8_0_BYTES 34 /* fp16 d, 32 signed bytes */
#define PANEL 16      /* rows of W widened together: 16 x K bfloat16, within L1 for K = 576 */
#define GROUP 4       /* rows of W a tile multiplies */
#define ROWS_X 4      /* the most rows of x a tile multiplies */

int quantized_linear_bf16_available(void);
int quantized_linear_bf16(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t x_stride, const uint8_t *w,
                          const float *bias, int32_t M, int32_t N, int32_t K, int32_t format);

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>

int quantized_linear_bf16_available(void) { return 1; }

/* The block's fp16 scale and (Q4_1) minimum, broadcast. */
static inline __attribute__((always_inline)) void block_scales(const uint8_t *block, __m512 *d, __m512 *m)
{
    int32_t both;
    memcpy(&both, block, sizeof both);
    const __m128 halves = _mm_cvtph_ps(_mm_cvtsi32_si128(both));
    *d = _mm512_broadcastss_ps(halves);
    *m = _mm512_broadcastss_ps(_mm_movehdup_ps(halves));
}

/* The 32 weights of a block, rounded to bfloat16, in order. A Q4_1 block holds 16 distinct
 * weights, d*q + m for q in 0..15: those are computed and rounded once, on 16 lanes, and the
 * nibbles pick from them (VPERMW), in fewer instructions than widening 32 codes to floats. */
static inline __attribute__((always_inline)) __m512bh widen_block(const uint8_t *block, const int format)
{
    if (format == FORMAT_Q4_1) {
        int32_t both;
        memcpy(&both, block, sizeof both);
        const __m128 halves = _mm_cvtph_ps(_mm_cvtsi32_si128(both));
        const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 values = _mm512_fmadd_ps(_mm512_broadcastss_ps(halves), codes,
                                              _mm512_broadcastss_ps(_mm_movehdup_ps(halves)));
        const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(block + 4)));
        const __m512i index = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(0x0f))), _mm256_srli_epi16(bytes, 4), 1);
        return (__m512bh)_mm512_permutexvar_epi16(index, table);
    }
    __m512 d, m;
    block_scales(block, &d, &m);
    const __m128i low_codes = _mm_loadu_si128((const __m128i *)(block + 2));
    const __m128i high_codes = _mm_loadu_si128((const __m128i *)(block + 18));
    const __m512 lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(low_codes)));
    const __m512 hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(high_codes)));
    return _mm512_cvtne2ps_pbh(hi, lo); /* elements 0-15 from lo, 16-31 from hi */
}

/* rows_w rows of W from w into panel [PANEL, K] bfloat16; rows past rows_w are zeros. */
static void widen_panel(const uint8_t *w, int64_t row_bytes, int32_t rows_w, int32_t K, const int format,
                        uint16_t *restrict panel)
{
    const int block_bytes = format == FORMAT_Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
    for (int32_t r = 0; r < rows_w; r++)
        for (int32_t b = 0; b < K / BLOCK; b++) {
            const __m512bh v = format == FORMAT_Q4_1 ? widen_block(w + r * row_bytes + (int64_t)b * block_bytes, 0)
                                                     : widen_block(w + r * row_bytes + (int64_t)b * block_bytes, 1);
            _mm512_store_si512((__m512i *)(panel + (int64_t)r * K + b * BLOCK), (__m512i)v);
        }
    for (int32_t r = rows_w; r < PANEL; r++)
        memset(panel + (int64_t)r * K, 0, sizeof(uint16_t) * (size_t)K);
}

/* The four sums' lanes added: [sum a0, sum a1, sum a2, sum a3]. */
static inline __attribute__((always_inline)) __m128 sum_four(__m512 a0, __m512 a1, __m512 a2, __m512 a3)
{
    /* per 128-bit quarter: [a0 a1 a0 a1] and [a2 a3 a2 a3] partial sums, then [a0 a2 a1 a3] */
    const __m512 p01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 p23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 q = _mm512_add_ps(_mm512_unpacklo_ps(p01, p23), _mm512_unpackhi_ps(p01, p23));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(q), _mm512_extractf32x8_ps(q, 1));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    return _mm_shuffle_ps(s, s, _MM_SHUFFLE(3, 1, 2, 0));
}

/* out[rows_x, GROUP] = x[rows_x, K] . group[GROUP, K]^T + bias, rounded to bfloat16; only the
 * first cols outputs of each row are stored. rows_x is a constant after inlining, so the
 * ROWS_X * GROUP sums stay in registers. */
static inline __attribute__((always_inline)) void tile(uint16_t *out, int64_t out_stride, const uint16_t *x,
                                                       int64_t x_stride, const uint16_t *group, const float *bias,
                                                       const int rows_x, int32_t cols, int32_t K)
{
    __m512 acc[ROWS_X][GROUP];
    for (int i = 0; i < rows_x; i++)
        for (int r = 0; r < GROUP; r++)
            acc[i][r] = _mm512_setzero_ps();
    for (int32_t k = 0; k < K; k += BLOCK) {
        __m512bh wv[GROUP];
        for (int r = 0; r < GROUP; r++)
            wv[r] = (__m512bh)_mm512_load_si512((const __m512i *)(group + (int64_t)r * K + k));
        for (int i = 0; i < rows_x; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const __m512i *)(x + i * x_stride + k));
            for (int r = 0; r < GROUP; r++)
                acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
        }
    }
    float b[GROUP] = {0};
    if (bias != NULL)
        memcpy(b, bias, sizeof(float) * (size_t)cols);
    const __m128 bias_v = _mm_loadu_ps(b);
    for (int i = 0; i < rows_x; i++) {
        const __m128 y = _mm_add_ps(sum_four(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), bias_v);
        const __m128bh rounded = _mm_cvtneps_pbh(y);
        uint16_t bits[8];
        memcpy(bits, &rounded, sizeof rounded);
        memcpy(out + i * out_stride, bits, sizeof(uint16_t) * (size_t)cols);
    }
}

#define SPECIALISE(name, rows_x)                                                                               \
    static void name(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t x_stride,                \
                     const uint16_t *group, const float *bias, int32_t cols, int32_t K)                      \
    {                                                                                                        \
        tile(out, out_stride, x, x_stride, group, bias, rows_x, cols, K);                                     \
    }
SPECIALISE(tile_x1, 1)
SPECIALISE(tile_x2, 2)
SPECIALISE(tile_x3, 3)
SPECIALISE(tile_x4, 4)

typedef void (*TileFn)(uint16_t *, int64_t, const uint16_t *, int64_t, const uint16_t *, const float *, int32_t,
                       int32_t);
static const TileFn TILES[ROWS_X] = {tile_x1, tile_x2, tile_x3, tile_x4};

/* One panel of rows_w rows of W against all M rows of x, in tiles of heights as even as they
 * go (a tile of one row has too few sums to keep the multiply-adds busy). */
static void panel_product(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t x_stride,
                          const uint16_t *panel, const float *bias, int32_t M, int32_t rows_w, int32_t K)
{
    const int32_t tiles = (M + ROWS_X - 1) / ROWS_X;
    for (int32_t g = 0; g < rows_w; g += GROUP) {
        const int32_t cols = rows_w - g < GROUP ? rows_w - g : GROUP;
        for (int32_t t = 0, i = 0; t < tiles; i += M / tiles + (t < M % tiles), t++) {
            const int32_t rows_x = M / tiles + (t < M % tiles);
            TILES[rows_x - 1](out + i * out_stride + g, out_stride, x + i * x_stride, x_stride,
                              panel + (int64_t)g * K, bias ? bias + g : NULL, cols, K);
        }
    }
}

/* out [M, N] bfloat16 (row stride out_stride) = x [M, K] bfloat16 (row stride x_stride) W^T +
 * bias, W [N, K] as N rows of K / 32 blocks, format 0 Q4_1 or 1 Q8_0, each weight rounded to
 * bfloat16; bias float32 or NULL. Returns 0; 1 when a thread could not allocate its scratch
 * (nothing is then computed); 2 for arguments it does not take (K not a multiple of 32, an
 * unknown format). */
int quantized_linear_bf16(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t x_stride, const uint8_t *w,
                          const float *bias, int32_t M, int32_t N, int32_t K, int32_t format)
{
    if (K % BLOCK != 0 || (format != FORMAT_Q4_1 && format != FORMAT_Q8_0) || M < 0 || N < 0)
        return 2;
    if (M == 0 || N == 0)
        return 0;
    const int64_t row_bytes = (int64_t)(K / BLOCK) * (format == FORMAT_Q4_1 ? Q4_1_BYTES : Q8_0_BYTES);
    const int32_t panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *panel = aligned_alloc(64, sizeof(uint16_t) * PANEL * (size_t)K);
        if (panel == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int32_t p = 0; p < panels; p++) {
                const int32_t n = p * PANEL, rows_w = N - n < PANEL ? N - n : PANEL;
                widen_panel(w + n * row_bytes, row_bytes, rows_w, K, format, panel);
                panel_product(out + n, out_stride, x, x_stride, panel, bias ? bias + n : NULL, M, rows_w, K);
            }
        }
        free(panel);
    }
    return failed;
}
#else
int quantized_linear_bf16_available(void) { return 0; }

int quantized_linear_bf16(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t x_stride, const uint8_t *w,
                          const float *bias, int32_t M, int32_t N, int32_t K, int32_t format)
{
    (void)out, (void)out_stride, (void)x, (void)x_stride, (void)w, (void)bias, (void)M, (void)N, (void)K,
        (void)format;
    return 3;
}
#endif
