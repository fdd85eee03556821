/*
 * Sampling by the Gumbel-max trick on the CPU: for each row, the vocab id with the highest
 * score + Gumbel noise, the noise a pure function of (row key, vocab id). The reference is
 * shared/engine/sampler.py (`gumbel_noise`, then an argmax): there it is about twenty passes
 * over a [rows, vocab] int64 or float32 tensor, 15 ms of a 50-70 ms decode step at 32 rows on
 * 2 cores; here it is one pass that keeps nothing but one block of sums per thread.
 *
 * The hash (Wellons' lowbias32) and the uniform it gives are bitwise the reference's. The two
 * logarithms are a polynomial (Cephes' logf, within about an ulp of torch's), so the noise can
 * differ from the reference's in its last bit, and a token only where two sums tie that
 * closely. Built with -ffp-contract=off, so every machine computes the same bits: a request's
 * tokens do not depend on which host sampled them.
 *
 * Return codes: 0 ok, 1 a row of no finite score.
 */
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define BLOCK 1024 /* sums computed (vectorised) before they are scanned for the maximum */
#define ROWS_PER_THREAD_MIN 2 /* fewer rows run on the calling thread: waking the team costs more */

ALWAYS_INLINE uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    return x ^ (x >> 15);
}

/* ln(x) for a positive normal float: Cephes' logf, branch-free so that it vectorises. */
ALWAYS_INLINE float log_f32(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    int exponent = (int)((bits >> 23) & 0xff) - 127;
    bits = (bits & 0x007fffffu) | 0x3f800000u;
    float m;
    memcpy(&m, &bits, sizeof m); /* [1, 2) */
    int high = m > 1.41421356f;
    m = high ? 0.5f * m : m; /* [0.707, 1.414) */
    float e = (float)(exponent + high);
    float f = m - 1.0f;
    float z = f * f;
    float y = 7.0376836292e-2f;
    y = y * f - 1.1514610310e-1f;
    y = y * f + 1.1676998740e-1f;
    y = y * f - 1.2420140846e-1f;
    y = y * f + 1.4249322787e-1f;
    y = y * f - 1.6668057665e-1f;
    y = y * f + 2.0000714765e-1f;
    y = y * f - 2.4999993993e-1f;
    y = y * f + 3.3333331174e-1f;
    y = y * f * z;
    y = y + -2.12194440e-4f * e;
    y = y - 0.5f * z;
    return (f + y) + 0.693359375f * e;
}

/* Noise of vocab id v for a row keyed `key`: -log(-log(u)), u = (23 hash bits + 0.5) / 2**23. */
ALWAYS_INLINE float gumbel(uint32_t key, uint32_t v, uint32_t vocab_salt) {
    uint32_t bits = mix32(key ^ mix32(v ^ vocab_salt));
    float u = ((float)(bits >> 9) + 0.5f) * 0x1p-23f;
    return -log_f32(-log_f32(u));
}

static int64_t row_argmax(const float *restrict scores, uint32_t key, int32_t vocab, uint32_t vocab_salt) {
    float sums[BLOCK];
    float best = -__builtin_inff();
    int64_t best_id = -1;
    for (int32_t start = 0; start < vocab; start += BLOCK) {
        int32_t n = vocab - start < BLOCK ? vocab - start : BLOCK;
        for (int32_t i = 0; i < n; i++)
            sums[i] = scores[start + i] + gumbel(key, (uint32_t)(start + i), vocab_salt);
        for (int32_t i = 0; i < n; i++) /* strict: ties go to the lowest id, as torch's max does */
            if (sums[i] > best) {
                best = sums[i];
                best_id = start + i;
            }
    }
    return best_id;
}

/* out[r] = argmax over v of scores[r, v] + gumbel(keys[r], v); keys hold uint32 values. */
int gumbel_argmax(int64_t *out, const float *scores, int64_t stride, const int64_t *keys, int64_t rows,
                  int32_t vocab, int64_t vocab_salt) {
    int failed = 0;
#pragma omp parallel for schedule(static) if (rows >= 2 * ROWS_PER_THREAD_MIN) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        out[r] = row_argmax(scores + r * stride, (uint32_t)keys[r], vocab, (uint32_t)vocab_salt);
        failed |= out[r] < 0;
    }
    return failed;
}

/*
 * Greedy decoding's argmax: the first vocab id of each row's largest score, as torch's
 * max(dim).indices gives it for scores without NaN. torch's indexed max walks a row one
 * element at a time, 10 ms for 128 rows of a 49k vocabulary on one core (its amax, without
 * the index, 1 ms); here the row's maximum comes from wide compares, block by block, and the
 * index from the one block that holds it.
 */
#define ARGMAX_BLOCK 512
#define LANES 16

static int64_t row_first_max(const float *restrict x, int32_t vocab) {
    float best = -__builtin_inff();
    int32_t best_block = -1;
    for (int32_t start = 0; start < vocab; start += ARGMAX_BLOCK) {
        int32_t n = vocab - start < ARGMAX_BLOCK ? vocab - start : ARGMAX_BLOCK;
        float lanes[LANES];
        for (int l = 0; l < LANES; l++)
            lanes[l] = -__builtin_inff();
        int32_t whole = n - n % LANES;
        for (int32_t i = 0; i < whole; i += LANES)
            for (int l = 0; l < LANES; l++)
                lanes[l] = x[start + i + l] > lanes[l] ? x[start + i + l] : lanes[l];
        float block_max = -__builtin_inff();
        for (int l = 0; l < LANES; l++)
            block_max = lanes[l] > block_max ? lanes[l] : block_max;
        for (int32_t i = whole; i < n; i++)
            block_max = x[start + i] > block_max ? x[start + i] : block_max;
        if (block_max > best) { /* strict: an equal maximum in a later block loses */
            best = block_max;
            best_block = start;
        }
    }
    if (best_block < 0)
        return -1;
    for (int32_t i = best_block;; i++)
        if (x[i] == best)
            return i;
}

/* out[r] = the first v of the largest scores[r, v]; 1 where a row has no value above -inf. */
int argmax_rows(int64_t *out, const float *scores, int64_t stride, int64_t rows, int32_t vocab) {
    int failed = 0;
#pragma omp parallel for schedule(static) if (rows >= 2 * ROWS_PER_THREAD_MIN) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        out[r] = row_first_max(scores + r * stride, vocab);
        failed |= out[r] < 0;
    }
    return failed;
}

