/* y = x W^T + b on the CPU with W kept in its GGUF block format (Q4_1 or Q8_0), x and y float32.
 *
 * A decode step at small batch reads every weight once and does two flops with it, so its
 * time is the time to stream the weights from memory. The default model ships as Q4_1
 * (0.625 bytes a weight) with a Q8_0 embedding (1.06 bytes); held in float32 it streams
 * 4 bytes a weight. Here each block is widened in registers, exactly as the dequantiser
 * does it, and used at once: 6.4x fewer bytes for the layers, 3.8x for the LM head.
 *
 * The widened weight is bitwise the float32 the loader makes: a Q4_1 weight is d*q + m
 * with d an fp16 and q in 0..15, so d*q has at most 15 significant bits and is exact, and
 * one rounding remains, which a fused multiply-add makes too; a Q8_0 weight is d*q with q
 * in -128..127, exact. Only the order of the sums differs from a float32 GEMM (rounding,
 * about 1e-6 relative).
 *
 * Up to ROWS_X rows of x: tiles of those rows by ROWS_W rows of W, 8 lanes along K; each step
 * widens ROWS_W weight vectors in registers and does rows_x * ROWS_W fused multiply-adds,
 * within AVX2's 16 registers (4 x 2 beat 3 x 2 on a 2-core EPYC; wider tiles spill). More rows
 * of x: each pair of W rows is widened once into a per-thread scratch (L1-sized for the model's
 * K), which even tiles of 3 to WIDE_ROWS_X rows of x then read: at 6 rows, eight loads and 12
 * fused multiply-adds a step. Either way the arithmetic grows with the batch while the bytes do not,
 * so past about 24 rows of x, where both are bound by arithmetic, oneDNN's float32 product
 * is faster. Rows of W are split between torch's OpenMP threads, each streaming a contiguous range.
 * Without AVX2 and F16C a plain C loop does the same arithmetic. Built and loaded by
 * kernels/quantized_linear.py.
 *
 * For a bfloat16 model the formats 2 and 3 round each widened weight to bfloat16, as the
 * loader's copy of it is rounded, and the caller widens x from bfloat16 (exactly) and rounds y
 * back: the products then differ from oneDNN's bfloat16 ones (float32 sums as well) only in the
 * order of their sums, and read 0.6-1.1 bytes a weight instead of 2.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define BLOCK 32
#define FORMAT_Q4_1 0
#define FORMAT_Q8_0 1
/* formats 2 and 3: Q4_1 and Q8_0 with each widened weight rounded to bfloat16, so that a
 * bfloat16 model's small products use the very weights its oneDNN products do */
#define FORMAT_BF16 2
#define IS_Q4_1(format) (((format) & 1) == FORMAT_Q4_1)
#define ROUNDS_BF16(format) ((format) >= FORMAT_BF16)
#define Q4_1_BYTES 20 /* fp16 d, fp16 m, 16 bytes of nibbles: low nibbles are elements 0-15 */
#define Q8_0_BYTES 34 /* fp16 d, 32 signed bytes */
#define ROWS_X 4
#define ROWS_W 2
#define WIDE_ROWS_X 6
#define PREFETCH_BYTES 1024

static inline float half_to_float(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, sizeof h);
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise the mantissa */
        exponent = 113u;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float32 -> bfloat16 (weights are finite: no NaN case). */
static inline float bf16_rounded(float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* The 32 float32 weights of one block, as the dequantiser computes them (then rounded to
 * bfloat16 in the bfloat16 formats). */
static inline void widen_block(const uint8_t *block, const int format, float *restrict w)
{
    const float d = half_to_float(block);
    if (IS_Q4_1(format)) {
        const float m = half_to_float(block + 2);
        for (int j = 0; j < BLOCK / 2; j++) {
            w[j] = d * (float)(block[4 + j] & 0x0f) + m;
            w[j + BLOCK / 2] = d * (float)(block[4 + j] >> 4) + m;
        }
    } else {
        for (int j = 0; j < BLOCK; j++)
            w[j] = d * (float)(int8_t)block[2 + j];
    }
    if (ROUNDS_BF16(format))
        for (int j = 0; j < BLOCK; j++)
            w[j] = bf16_rounded(w[j]);
}

static void tile_plain(float *out, int64_t out_stride, const float *x, int64_t x_stride, const uint8_t *w,
                       int64_t row_bytes, const float *bias, int32_t rows_x, int32_t rows_w, int32_t K, int format)
{
    const int block_bytes = IS_Q4_1(format) ? Q4_1_BYTES : Q8_0_BYTES;
    for (int32_t n = 0; n < rows_w; n++) {
        float acc[ROWS_X] = {0};
        for (int32_t b = 0; b < K / BLOCK; b++) {
            float wb[BLOCK];
            widen_block(w + n * row_bytes + (int64_t)b * block_bytes, format, wb);
            for (int32_t i = 0; i < rows_x; i++)
                for (int j = 0; j < BLOCK; j++)
                    acc[i] += wb[j] * x[i * x_stride + b * BLOCK + j];
        }
        for (int32_t i = 0; i < rows_x; i++)
            out[i * out_stride + n] = acc[i] + (bias ? bias[n] : 0.0f);
    }
}

#ifdef HAVE_AVX2
static inline float sum_lanes(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The block's fp16 scale (and Q4_1 minimum, which follows it), widened together. */
static inline __m128 block_halves(const uint8_t *block)
{
    int32_t both;
    memcpy(&both, block, sizeof both);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(both));
}

static inline __attribute__((always_inline)) __m256 bf16_rounded_lanes(__m256 w)
{
    const __m256i u = _mm256_castps_si256(w);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32((int)0xffff0000u)));
}

/* Weights 8 * part .. 8 * part + 7 of a block whose scale is d (and minimum m, for Q4_1). */
static inline __attribute__((always_inline)) __m256 widen_part(const uint8_t *block, int part, __m256 d, __m256 m,
                                                               const int format)
{
    __m256 w;
    if (IS_Q4_1(format)) {
        /* parts 0, 1: low nibbles of bytes 0-7, 8-15; parts 2, 3: their high nibbles */
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 4 + (part & 1) * 8)));
        const __m256i q = part < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0x0f)) : _mm256_srli_epi32(bytes, 4);
        w = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m);
    } else {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + 2 + part * 8)));
        w = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
    }
    return ROUNDS_BF16(format) ? bf16_rounded_lanes(w) : w;
}

/* out[rows_x, ROWS_W] for one pair of weight rows; rows_x is a compile-time constant
 * after inlining, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_avx2(
    float *out, int64_t out_stride, const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
    const float *bias, const int rows_x, int32_t K, const int format)
{
    /* at one or two rows of x, two sums per output (even and odd parts of each block): a
     * fused multiply-add takes 4 cycles, and a chain of 4 per block would wait on itself;
     * more rows have chains enough, and their registers are needed */
    const int chains = rows_x == 1 ? 2 : 1;
    __m256 acc[ROWS_X][ROWS_W][2];
    for (int i = 0; i < rows_x; i++)
        for (int r = 0; r < ROWS_W; r++)
            for (int c = 0; c < chains; c++)
                acc[i][r][c] = _mm256_setzero_ps();
    const int block_bytes = IS_Q4_1(format) ? Q4_1_BYTES : Q8_0_BYTES;
    for (int32_t b = 0; b < K / BLOCK; b++) {
        const uint8_t *block[ROWS_W];
        __m256 d[ROWS_W], m[ROWS_W];
        for (int r = 0; r < ROWS_W; r++) {
            block[r] = w + r * row_bytes + (int64_t)b * block_bytes;
            /* the rows stream from memory once: ask for what comes a few blocks on */
            _mm_prefetch((const char *)block[r] + PREFETCH_BYTES, _MM_HINT_T0);
            const __m128 halves = block_halves(block[r]);
            d[r] = _mm256_broadcastss_ps(halves);
            if (IS_Q4_1(format))
                m[r] = _mm256_broadcastss_ps(_mm_movehdup_ps(halves));
        }
        for (int part = 0; part < BLOCK / 8; part++) {
            __m256 wv[ROWS_W];
            for (int r = 0; r < ROWS_W; r++)
                wv[r] = widen_part(block[r], part, d[r], IS_Q4_1(format) ? m[r] : d[r], format);
            for (int i = 0; i < rows_x; i++) {
                const __m256 xv = _mm256_loadu_ps(x + i * x_stride + b * BLOCK + part * 8);
                for (int r = 0; r < ROWS_W; r++)
                    acc[i][r][part % chains] = _mm256_fmadd_ps(wv[r], xv, acc[i][r][part % chains]);
            }
        }
    }
    for (int i = 0; i < rows_x; i++)
        for (int r = 0; r < ROWS_W; r++)
            out[i * out_stride + r] = sum_lanes(chains == 2 ? _mm256_add_ps(acc[i][r][0], acc[i][r][1]) : acc[i][r][0])
                                      + (bias ? bias[r] : 0.0f);
}

#define SPECIALISE(name, rows_x, format)                                                                       \
    static void name(float *out, int64_t out_stride, const float *x, int64_t x_stride, const uint8_t *w,   \
                     int64_t row_bytes, const float *bias, int32_t K)                                       \
    {                                                                                                        \
        tile_avx2(out, out_stride, x, x_stride, w, row_bytes, bias, rows_x, K, format);                      \
    }
SPECIALISE(q4_1_x1, 1, FORMAT_Q4_1)
SPECIALISE(q4_1_x2, 2, FORMAT_Q4_1)
SPECIALISE(q4_1_x3, 3, FORMAT_Q4_1)
SPECIALISE(q4_1_x4, 4, FORMAT_Q4_1)
SPECIALISE(q8_0_x1, 1, FORMAT_Q8_0)
SPECIALISE(q8_0_x2, 2, FORMAT_Q8_0)
SPECIALISE(q8_0_x3, 3, FORMAT_Q8_0)
SPECIALISE(q8_0_x4, 4, FORMAT_Q8_0)
SPECIALISE(q4_1_bf16_x1, 1, FORMAT_BF16 + FORMAT_Q4_1)
SPECIALISE(q4_1_bf16_x2, 2, FORMAT_BF16 + FORMAT_Q4_1)
SPECIALISE(q4_1_bf16_x3, 3, FORMAT_BF16 + FORMAT_Q4_1)
SPECIALISE(q4_1_bf16_x4, 4, FORMAT_BF16 + FORMAT_Q4_1)
SPECIALISE(q8_0_bf16_x1, 1, FORMAT_BF16 + FORMAT_Q8_0)
SPECIALISE(q8_0_bf16_x2, 2, FORMAT_BF16 + FORMAT_Q8_0)
SPECIALISE(q8_0_bf16_x3, 3, FORMAT_BF16 + FORMAT_Q8_0)
SPECIALISE(q8_0_bf16_x4, 4, FORMAT_BF16 + FORMAT_Q8_0)

typedef void (*TileFn)(float *, int64_t, const float *, int64_t, const uint8_t *, int64_t, const float *, int32_t);
static const TileFn TILES[4][ROWS_X] = {
    {q4_1_x1, q4_1_x2, q4_1_x3, q4_1_x4},
    {q8_0_x1, q8_0_x2, q8_0_x3, q8_0_x4},
    {q4_1_bf16_x1, q4_1_bf16_x2, q4_1_bf16_x3, q4_1_bf16_x4},
    {q8_0_bf16_x1, q8_0_bf16_x2, q8_0_bf16_x3, q8_0_bf16_x4},
};

/* Rows w, w + row_bytes widened into wide [ROWS_W, K] once, for batches of more than ROWS_X rows. */
static void widen_rows(const uint8_t *w, int64_t row_bytes, int32_t K, const int format, float *restrict wide)
{
    const int block_bytes = IS_Q4_1(format) ? Q4_1_BYTES : Q8_0_BYTES;
    for (int r = 0; r < ROWS_W; r++)
        for (int32_t b = 0; b < K / BLOCK; b++) {
            const uint8_t *block = w + r * row_bytes + (int64_t)b * block_bytes;
            _mm_prefetch((const char *)block + PREFETCH_BYTES, _MM_HINT_T0);
            const __m128 halves = block_halves(block);
            const __m256 d = _mm256_broadcastss_ps(halves), m = _mm256_broadcastss_ps(_mm_movehdup_ps(halves));
            for (int part = 0; part < BLOCK / 8; part++) {
                __m256 wv = IS_Q4_1(format) ? widen_part(block, part, d, m, FORMAT_Q4_1)
                                            : widen_part(block, part, d, d, FORMAT_Q8_0);
                _mm256_storeu_ps(wide + (int64_t)r * K + b * BLOCK + part * 8,
                                 ROUNDS_BF16(format) ? bf16_rounded_lanes(wv) : wv);
            }
        }
}

/* out[rows_x, ROWS_W] from two widened rows: 2 + rows_x loads and 2 * rows_x fused multiply-adds
 * a step, where the register-widening tile does two widenings and 2 * ROWS_X. Every vector is
 * loaded into a register once: left to itself gcc folds the loads of one operand into the
 * multiply-adds and so loads it again for each use (14 loads a step at 6 rows, the weights 4
 * times over at 4), and two loads a cycle, not the multiply-adds, then bound the tile. */
static inline __attribute__((always_inline)) void tile_widened(
    float *out, int64_t out_stride, const float *x, int64_t x_stride, const float *wide, const float *bias,
    const int rows_x, int32_t K)
{
    __m256 acc[WIDE_ROWS_X][ROWS_W];
    for (int i = 0; i < rows_x; i++)
        for (int r = 0; r < ROWS_W; r++)
            acc[i][r] = _mm256_setzero_ps();
    for (int32_t k = 0; k < K; k += 8) {
        __m256 wv[ROWS_W];
        for (int r = 0; r < ROWS_W; r++) {
            wv[r] = _mm256_loadu_ps(wide + (int64_t)r * K + k);
            __asm__("" : "+x"(wv[r])); /* a register from here on: no load folded into the multiply-adds */
        }
        for (int i = 0; i < rows_x; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * x_stride + k);
            __asm__("" : "+x"(xv));
            for (int r = 0; r < ROWS_W; r++)
                acc[i][r] = _mm256_fmadd_ps(wv[r], xv, acc[i][r]);
        }
    }
    for (int i = 0; i < rows_x; i++)
        for (int r = 0; r < ROWS_W; r++)
            out[i * out_stride + r] = sum_lanes(acc[i][r]) + (bias ? bias[r] : 0.0f);
}

#define SPECIALISE_WIDENED(name, rows_x)                                                                       \
    static void name(float *out, int64_t out_stride, const float *x, int64_t x_stride, const float *wide,     \
                     const float *bias, int32_t K)                                                            \
    {                                                                                                          \
        tile_widened(out, out_stride, x, x_stride, wide, bias, rows_x, K);                                     \
    }
SPECIALISE_WIDENED(widened_x3, 3)
SPECIALISE_WIDENED(widened_x4, 4)
SPECIALISE_WIDENED(widened_x5, 5)
SPECIALISE_WIDENED(widened_x6, 6)

typedef void (*WidenedTileFn)(float *, int64_t, const float *, int64_t, const float *, const float *, int32_t);
/* by rows_x - MIN_WIDE_ROWS_X: the balanced tiles of more than ROWS_X rows have 3-6 rows each */
#define MIN_WIDE_ROWS_X 3
static const WidenedTileFn WIDENED_TILES[WIDE_ROWS_X - MIN_WIDE_ROWS_X + 1] = {
    widened_x3, widened_x4, widened_x5, widened_x6,
};
#endif

/* A pair of weight rows against all of x: widened in registers per tile of up to ROWS_X rows,
 * or, for more rows than that (when `wide` is given), widened into `wide` once and read from
 * there by the fewest tiles of up to WIDE_ROWS_X rows, of heights as even as they go: a tile
 * of 1-2 rows has too few independent sums to keep the multiply-adds busy (the model's products
 * on one core of a 2-core EPYC: 8 rows as 6 + 2 took 11% longer than as 4 + 4, 20 rows as
 * 6 + 6 + 6 + 2 6% longer than as 4 x 5). */
static void pair_of_rows(float *out, int64_t out_stride, const float *x, int64_t x_stride, const uint8_t *w,
                         int64_t row_bytes, const float *bias, int32_t M, int32_t rows_w, int32_t K, int format,
                         float *wide)
{
#ifdef HAVE_AVX2
    if (rows_w == ROWS_W && wide != NULL) {
        widen_rows(w, row_bytes, K, format, wide);
        const int32_t tiles = (M + WIDE_ROWS_X - 1) / WIDE_ROWS_X; /* M > ROWS_X: M / tiles >= 3 */
        for (int32_t t = 0, i = 0; t < tiles; i += M / tiles + (t < M % tiles), t++) {
            const int32_t rows_x = M / tiles + (t < M % tiles);
            WIDENED_TILES[rows_x - MIN_WIDE_ROWS_X](out + i * out_stride, out_stride, x + i * x_stride, x_stride,
                                                    wide, bias, K);
        }
        return;
    }
#endif
    for (int32_t i = 0; i < M; i += ROWS_X) {
        const int32_t rows_x = M - i < ROWS_X ? M - i : ROWS_X;
#ifdef HAVE_AVX2
        if (rows_w == ROWS_W) {
            TILES[format][rows_x - 1](out + i * out_stride, out_stride, x + i * x_stride, x_stride, w, row_bytes,
                                      bias, K);
            continue;
        }
#endif
        tile_plain(out + i * out_stride, out_stride, x + i * x_stride, x_stride, w, row_bytes, bias, rows_x, rows_w,
                   K, format);
    }
}

/* out [M, N] (row stride out_stride) = x [M, K] (row stride x_stride) W^T + bias, W [N, K]
 * as N rows of K / 32 blocks. format 0: Q4_1, 1: Q8_0, 2 and 3: those with the weights rounded
 * to bfloat16. bias may be NULL. Returns 0; 1 when
 * a thread could not allocate its scratch (nothing is then computed); 2 for arguments it does
 * not take (K not a multiple of 32, an unknown format). */
int quantized_linear(float *out, int64_t out_stride, const float *x, int64_t x_stride, const uint8_t *w,
                     const float *bias, int32_t M, int32_t N, int32_t K, int32_t format)
{
    if (K % BLOCK != 0 || format < 0 || format > FORMAT_BF16 + FORMAT_Q8_0 || M < 0 || N < 0)
        return 2;
    const int64_t row_bytes = (int64_t)(K / BLOCK) * (IS_Q4_1(format) ? Q4_1_BYTES : Q8_0_BYTES);
    const int32_t pairs = (N + ROWS_W - 1) / ROWS_W;
    const int widen_once = M > ROWS_X;
    int failed = 0;
#pragma omp parallel
    {
        float *wide = widen_once ? malloc(sizeof(float) * ROWS_W * (size_t)K) : NULL;
        if (widen_once && wide == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int32_t p = 0; p < pairs; p++) {
                const int32_t n = p * ROWS_W, rows_w = N - n < ROWS_W ? N - n : ROWS_W;
                pair_of_rows(out + n, out_stride, x, x_stride, w + n * row_bytes, row_bytes, bias ? bias + n : NULL,
                             M, rows_w, K, format, wide);
            }
        }
        free(wide);
    }
    return failed;
}
