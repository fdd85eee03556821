/*
 * The small per-layer operators of a Llama layer on the CPU, for float32 and bfloat16:
 * RMSNorm with the residual add, rotary embedding with the KV cache write, and SwiGLU's
 * silu(gate) * up. In PyTorch each is five to fifteen operator calls; at decode batch sizes
 * those calls, not the arithmetic, are the cost (about 5 ms of a 40 ms batch-1 step of
 * SmolLM2-135M). Here each is one call.
 *
 * Every result is rounded to the model dtype exactly where Hugging Face's eager bf16 code
 * rounds it (see the PyTorch references beside the Python wrappers), and products are never
 * contracted into fused multiply-adds (built with -ffp-contract=off, no -ffast-math), so the
 * rotary embedding and the cache write are bitwise those of the references. RMSNorm sums its
 * squares in another order than torch's mean, and silu uses its own expf (exp_f32), so those
 * two agree with the references to float32 rounding, which bfloat16 output rounds away nearly
 * always.
 *
 * dtype: 0 float32, 1 bfloat16. Return codes: 0 ok, 1 unknown dtype or cache format, 3 a slot out of range,
 * 4 a position out of the cos/sin table.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lanes.h"

#define DTYPE_F32 0
#define DTYPE_BF16 1
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Work below this many elements runs on the calling thread: waking OpenMP's team costs more. */
#define PARALLEL_MIN_ELEMENTS (1 << 15)

ALWAYS_INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, NaN kept a quiet NaN: c10::BFloat16's conversion. */
ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

ALWAYS_INLINE float load(const void *base, int64_t i, int dtype) {
    return dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

ALWAYS_INLINE void store(void *base, int64_t i, float v, int dtype) {
    if (dtype == DTYPE_BF16)
        ((uint16_t *)base)[i] = f32_to_bf16(v);
    else
        ((float *)base)[i] = v;
}

/* The value as the model dtype holds it. */
ALWAYS_INLINE float rounded(float v, int dtype) { return dtype == DTYPE_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* The same, LANES elements at a time (lanes.h), written with GCC vector extensions. */

ALWAYS_INLINE vfloat vload(const void *base, int64_t i, int dtype) {
    vfloat v;
    if (dtype != DTYPE_BF16) {
        memcpy(&v, (const float *)base + i, sizeof v);
        return v;
    }
    vhalf h;
    memcpy(&h, (const uint16_t *)base + i, sizeof h);
    vuint bits = __builtin_convertvector(h, vuint) << 16;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* f32_to_bf16 of every lane, in the low half of each. */
ALWAYS_INLINE vuint vbf16_bits(vfloat v) {
    vuint u;
    memcpy(&u, &v, sizeof u);
    vuint nan = (vuint)((u & 0x7fffffffu) > 0x7f800000u);
    vuint even = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (even & ~nan) | (0x7fc0u & nan);
}

ALWAYS_INLINE void vstore(void *base, int64_t i, vfloat v, int dtype) {
    if (dtype != DTYPE_BF16) {
        memcpy((float *)base + i, &v, sizeof v);
        return;
    }
    vhalf h = __builtin_convertvector(vbf16_bits(v), vhalf);
    memcpy((uint16_t *)base + i, &h, sizeof h);
}

ALWAYS_INLINE vfloat vrounded(vfloat v, int dtype) {
    if (dtype != DTYPE_BF16)
        return v;
    vuint bits = vbf16_bits(v) << 16;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* ---- RMSNorm ---------------------------------------------------------------------------- */

#define SQUARE_CHAINS 4

/* The sum of a row's squares, SQUARE_CHAINS vectors of partial sums at a time. Written out:
 * gcc left an `omp simd` reduction here scalar, one chain of dependent adds three quarters of
 * the norm's time (a prefill of 256 tokens on one Zen 3 core: 34 ms of its 1,060). */
ALWAYS_INLINE float sum_of_squares(const void *row, int hidden, int dtype) {
    vfloat partial[SQUARE_CHAINS] = {0};
    int i = 0;
    for (; i + SQUARE_CHAINS * LANES <= hidden; i += SQUARE_CHAINS * LANES)
        for (int c = 0; c < SQUARE_CHAINS; c++) {
            vfloat v = vload(row, i + c * LANES, dtype);
            partial[c] += v * v;
        }
    for (int c = 1; c < SQUARE_CHAINS; c++)
        partial[0] += partial[c];
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++)
        sum += partial[0][l];
    for (; i < hidden; i++) {
        float v = load(row, i, dtype);
        sum += v * v;
    }
    return sum;
}

ALWAYS_INLINE void rms_norm_row(void *out, void *residual_out, const void *x, const void *residual,
                                const void *weight, int hidden, float eps, int dtype) {
    const void *normed_from = x;
    if (residual != NULL) {
        for (int i = 0; i < hidden; i++)  /* HF adds in the model dtype */
            store(residual_out, i, load(x, i, dtype) + load(residual, i, dtype), dtype);
        normed_from = residual_out;
    }
    float sum = sum_of_squares(normed_from, hidden, dtype);
    float inv_rms = 1.0f / sqrtf(sum / (float)hidden + eps);  /* torch.rsqrt: correctly rounded div of sqrt */
    for (int i = 0; i < hidden; i++) {
        float h = rounded(load(normed_from, i, dtype) * inv_rms, dtype);
        store(out, i, load(weight, i, dtype) * h, dtype);
    }
}

ALWAYS_INLINE void rms_norm_rows(void *out, int64_t stride_out, void *residual_out, int64_t stride_residual_out,
                                 const void *x, int64_t stride_x, const void *residual, int64_t stride_residual,
                                 const void *weight, int64_t rows, int hidden, float eps, int dtype) {
    size_t size = dtype == DTYPE_BF16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        rms_norm_row((char *)out + r * stride_out * size,
                     residual != NULL ? (char *)residual_out + r * stride_residual_out * size : NULL,
                     (const char *)x + r * stride_x * size,
                     residual != NULL ? (const char *)residual + r * stride_residual * size : NULL,
                     weight, hidden, eps, dtype);
    }
}

/* out = weight * norm(x + residual), residual_out = x + residual; residual may be NULL (then
 * residual_out is untouched). Strides are in elements, between rows; rows are contiguous. */
int rms_norm(void *out, int64_t stride_out, void *residual_out, int64_t stride_residual_out,
             const void *x, int64_t stride_x, const void *residual, int64_t stride_residual,
             const void *weight, int64_t rows, int32_t hidden, float eps, int32_t dtype) {
    if (dtype == DTYPE_F32)
        rms_norm_rows(out, stride_out, residual_out, stride_residual_out, x, stride_x, residual, stride_residual,
                      weight, rows, hidden, eps, DTYPE_F32);
    else if (dtype == DTYPE_BF16)
        rms_norm_rows(out, stride_out, residual_out, stride_residual_out, x, stride_x, residual, stride_residual,
                      weight, rows, hidden, eps, DTYPE_BF16);
    else
        return 1;
    return 0;
}

/* ---- rotary embedding and the KV cache write -------------------------------------------- */

/* NeoX / HF rotate_half on one head, in place, for pairs [from, half): each product rounded,
 * then the sum. */
ALWAYS_INLINE void rotate_head_tail(void *head, const float *cos_sin, int from, int half, int dtype) {
    for (int i = from; i < half; i++) {
        float c = rounded(cos_sin[i], dtype), s = rounded(cos_sin[half + i], dtype);  /* HF casts cos, sin first */
        float x1 = load(head, i, dtype), x2 = load(head, half + i, dtype);
        float out1 = rounded(x1 * c, dtype) - rounded(x2 * s, dtype);
        float out2 = rounded(x2 * c, dtype) + rounded(x1 * s, dtype);
        store(head, i, out1, dtype);
        store(head, half + i, out2, dtype);
    }
}

/* Pairs [i, i + LANES) of one head, with cos and sin already rounded to the dtype. */
ALWAYS_INLINE void rotate_lanes(void *head, int64_t i, int half, vfloat c, vfloat s, int dtype) {
    vfloat x1 = vload(head, i, dtype), x2 = vload(head, half + i, dtype);
    vstore(head, i, vrounded(x1 * c, dtype) - vrounded(x2 * s, dtype), dtype);
    vstore(head, half + i, vrounded(x2 * c, dtype) + vrounded(x1 * s, dtype), dtype);
}

/* One token's heads: LANES pairs at a time across all of them, so each slice of cos and sin
 * is loaded and rounded once per token, not once per head; a head_dim / 2 that is not a
 * multiple of LANES ends in scalar code. */
ALWAYS_INLINE void rotate_token(char *q, int64_t stride_q_head, int num_heads, char *k, int64_t stride_k_head,
                                int num_kv_heads, const float *cos_sin, int half, size_t size, int dtype) {
    int i = 0;
    for (; i + LANES <= half; i += LANES) {
        vfloat c = vrounded(vload(cos_sin, i, DTYPE_F32), dtype), s = vrounded(vload(cos_sin, half + i, DTYPE_F32), dtype);
        for (int h = 0; h < num_heads; h++)
            rotate_lanes(q + h * stride_q_head * size, i, half, c, s, dtype);
        for (int h = 0; h < num_kv_heads; h++)
            rotate_lanes(k + h * stride_k_head * size, i, half, c, s, dtype);
    }
    if (i < half) {
        for (int h = 0; h < num_heads; h++)
            rotate_head_tail(q + h * stride_q_head * size, cos_sin, i, half, dtype);
        for (int h = 0; h < num_kv_heads; h++)
            rotate_head_tail(k + h * stride_k_head * size, cos_sin, i, half, dtype);
    }
}

/* float32 -> a small float (fp8, float16) with `mant` mantissa bits and exponent bias `bias`,
 * rounded to nearest even as torch converts; |x| must lie within the format's range. */
ALWAYS_INLINE uint32_t to_small_float(float x, int mant, int bias, int sign_bit) {
    const uint32_t sign = signbit(x) ? 1u << sign_bit : 0u;
    int e;
    frexpf(fabsf(x), &e);
    /* subnormals share the smallest normal binade's step */
    const int binade = e - 1 < 1 - bias ? 1 - bias : e - 1;
    const float step = ldexpf(1.0f, binade - mant);
    const float r = nearbyintf(fabsf(x) / step) * step;
    if (r == 0.0f) return sign;
    frexpf(r, &e);
    if (e - 1 < 1 - bias) return sign | (uint32_t)(r / step);
    return sign | ((uint32_t)(e - 1 + bias) << mant) | ((uint32_t)ldexpf(r, mant - (e - 1)) - (1u << mant));
}

ALWAYS_INLINE float clamp_to(float x, float limit) { return x > limit ? limit : x < -limit ? -limit : x; }

/* One head's row (head_dim values in the model dtype) stored in cache format kv (lanes.h), the
 * 8-bit ones as codes then the row's scale, max |x| / the format's largest code, exactly as
 * kernels/kv_quant.py's reference quantises. */
ALWAYS_INLINE void store_kv_row(uint8_t *row, const char *src, int head_dim, int dtype, int kv) {
    const float max = kv == KV_E4M3 ? 448.0f : kv == KV_E5M2 ? 57344.0f : kv == KV_I8 ? 127.0f : 65504.0f;
    float scale = 1.0f;
    if (kv >= KV_E4M3) {
        float amax = 0.0f;
        for (int i = 0; i < head_dim; i++) amax = fmaxf(amax, fabsf(load(src, i, dtype)));
        if (amax > 0.0f) scale = amax / max;
        memcpy(row + head_dim, &scale, sizeof scale);
    }
    for (int i = 0; i < head_dim; i++) {
        const float x = load(src, i, dtype);
        switch (kv) {
        case KV_F32: ((float *)row)[i] = x; break;
        case KV_BF16: ((uint16_t *)row)[i] = f32_to_bf16(x); break;
        case KV_F16: ((uint16_t *)row)[i] = (uint16_t)to_small_float(clamp_to(x, max), 10, 15, 15); break;
        case KV_E4M3: row[i] = (uint8_t)to_small_float(clamp_to(x / scale, max), 3, 7, 7); break;
        case KV_E5M2: row[i] = (uint8_t)to_small_float(clamp_to(x / scale, max), 2, 15, 7); break;
        default: ((int8_t *)row)[i] = (int8_t)nearbyintf(clamp_to(x / scale, max)); break;
        }
    }
}

ALWAYS_INLINE void rotary_kv_write_tokens(
    void *q, int64_t stride_q_token, int64_t stride_q_head, void *k, int64_t stride_k_token, int64_t stride_k_head,
    const void *v, int64_t stride_v_token, int64_t stride_v_head, const int64_t *positions, const float *cos_sin_cache,
    int64_t stride_cos_sin, void *k_cache, int64_t kc_block, int64_t kc_token, int64_t kc_head, void *v_cache,
    int64_t vc_block, int64_t vc_token, int64_t vc_head, const int64_t *slot_mapping, int64_t num_tokens,
    int num_heads, int num_kv_heads, int head_dim, int block_size, int dtype, int kv) {
    size_t size = dtype == DTYPE_BF16 ? 2 : 4, cache_size = (size_t)kv_size(kv);
    size_t row_bytes = (size_t)head_dim * size;
    int64_t elements = num_tokens * (int64_t)(num_heads + 2 * num_kv_heads) * head_dim;
#pragma omp parallel for schedule(static) if (elements >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        char *q_token = (char *)q + t * stride_q_token * size, *k_token = (char *)k + t * stride_k_token * size;
        rotate_token(q_token, stride_q_head, num_heads, k_token, stride_k_head, num_kv_heads,
                     cos_sin_cache + positions[t] * stride_cos_sin, head_dim / 2, size, dtype);
        int64_t block = slot_mapping[t] / block_size, offset = slot_mapping[t] % block_size;
        for (int h = 0; h < num_kv_heads; h++) {
            uint8_t *k_row = (uint8_t *)k_cache + (block * kc_block + offset * kc_token + h * kc_head) * cache_size;
            uint8_t *v_row = (uint8_t *)v_cache + (block * vc_block + offset * vc_token + h * vc_head) * cache_size;
            const char *k_src = k_token + h * stride_k_head * size;
            const char *v_src = (const char *)v + (t * stride_v_token + h * stride_v_head) * size;
            if (kv == dtype) { /* the model dtype's codes are the cache's */
                memcpy(k_row, k_src, row_bytes);
                memcpy(v_row, v_src, row_bytes);
            } else {
                store_kv_row(k_row, k_src, head_dim, dtype, kv);
                store_kv_row(v_row, v_src, head_dim, dtype, kv);
            }
        }
    }
}

/* Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place by their
 * positions (cos_sin_cache rows: cos then sin, float32), then store k and v at their slots of
 * the caches [blocks, block_size, kv_heads, row], in cache format kv (lanes.h: a row is
 * head_dim values, or head_dim codes and a scale in the 8-bit formats). The last dim of every
 * tensor is contiguous; strides are in elements (the cache's: bytes in the 8-bit formats). Slots and positions are checked against num_slots and
 * num_positions before anything is written. */
int rotary_kv_write(
    void *q, int64_t stride_q_token, int64_t stride_q_head, void *k, int64_t stride_k_token, int64_t stride_k_head,
    const void *v, int64_t stride_v_token, int64_t stride_v_head, const int64_t *positions, const float *cos_sin_cache,
    int64_t stride_cos_sin, int64_t num_positions, void *k_cache, int64_t kc_block, int64_t kc_token,
    int64_t kc_head, void *v_cache, int64_t vc_block, int64_t vc_token, int64_t vc_head,
    const int64_t *slot_mapping, int64_t num_slots, int64_t num_tokens, int32_t num_heads, int32_t num_kv_heads,
    int32_t head_dim, int32_t block_size, int32_t dtype, int32_t kv) {
    if (kv < KV_F32 || kv > KV_I8) return 1;
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return 3;
        if (positions[t] < 0 || positions[t] >= num_positions) return 4;
    }
    if (dtype == DTYPE_F32)
        rotary_kv_write_tokens(q, stride_q_token, stride_q_head, k, stride_k_token, stride_k_head, v, stride_v_token,
                               stride_v_head, positions, cos_sin_cache, stride_cos_sin, k_cache, kc_block, kc_token,
                               kc_head, v_cache, vc_block, vc_token, vc_head, slot_mapping, num_tokens, num_heads,
                               num_kv_heads, head_dim, block_size, DTYPE_F32, kv);
    else if (dtype == DTYPE_BF16)
        rotary_kv_write_tokens(q, stride_q_token, stride_q_head, k, stride_k_token, stride_k_head, v, stride_v_token,
                               stride_v_head, positions, cos_sin_cache, stride_cos_sin, k_cache, kc_block, kc_token,
                               kc_head, v_cache, vc_block, vc_token, vc_head, slot_mapping, num_tokens, num_heads,
                               num_kv_heads, head_dim, block_size, DTYPE_BF16, kv);
    else
        return 1;
    return 0;
}

/* ---- SwiGLU ----------------------------------------------------------------------------- */

/* The clamps of exp_f32 vectorise only where no NaN need be kept: a NaN gate (a model already
 * broken) gives some finite value here, where torch would give NaN. */
#define FINITE_MATH __attribute__((optimize("finite-math-only", "no-signed-zeros")))

/* e^x in float32 to about 2 ulp (Cephes' expf): range reduction by ln 2, a degree-6 polynomial,
 * and the exponent set in the bits. Unlike libm's expf it has no call in it, so loops over it
 * vectorise (glibc's vector expf is only declared under -ffast-math, which this file avoids). */
ALWAYS_INLINE FINITE_MATH float exp_f32(float x) {
    x = fminf(fmaxf(x, -87.3f), 88.7f);
    float t = x * 1.44269504088896341f + 0.5f;
    int32_t floor_t = (int32_t)t;  /* truncates toward zero: one less for negative non-integers */
    floor_t -= (float)floor_t > t;
    float n = (float)floor_t;
    float r = x - n * 0.693359375f - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (floor_t + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* One function per dtype, not inlined into the OpenMP loop: the outlined loop body loses
 * FINITE_MATH and the knowledge that the rows do not alias, and with them the vectorisation. */
#define DEFINE_SILU_AND_MUL_ROW(name, dtype)                                                          \
    __attribute__((noinline)) FINITE_MATH static void name(char *restrict dst, const char *restrict row, \
                                                         int intermediate) {                          \
        for (int i = 0; i < intermediate; i++) {                                                      \
            float gate = load(row, i, dtype), up = load(row, intermediate + i, dtype);                 \
            float act = rounded(gate / (1.0f + exp_f32(-gate)), dtype); /* F.silu's, in the dtype */   \
            store(dst, i, act * up, dtype);                                                           \
        }                                                                                             \
    }
DEFINE_SILU_AND_MUL_ROW(silu_and_mul_row_f32, DTYPE_F32)
DEFINE_SILU_AND_MUL_ROW(silu_and_mul_row_bf16, DTYPE_BF16)

ALWAYS_INLINE void silu_and_mul_rows(void *out, int64_t stride_out, const void *x, int64_t stride_x, int64_t rows,
                                     int intermediate, int dtype) {
    size_t size = dtype == DTYPE_BF16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows * intermediate >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        char *dst = (char *)out + r * stride_out * size;
        const char *row = (const char *)x + r * stride_x * size;
        if (dtype == DTYPE_BF16)
            silu_and_mul_row_bf16(dst, row, intermediate);
        else
            silu_and_mul_row_f32(dst, row, intermediate);
    }
}

/* out [rows, intermediate] = silu(x[:, :intermediate]) * x[:, intermediate:]. */
int silu_and_mul(void *out, int64_t stride_out, const void *x, int64_t stride_x, int64_t rows, int32_t intermediate,
                 int32_t dtype) {
    if (dtype == DTYPE_F32)
        silu_and_mul_rows(out, stride_out, x, stride_x, rows, intermediate, DTYPE_F32);
    else if (dtype == DTYPE_BF16)
        silu_and_mul_rows(out, stride_out, x, stride_x, rows, intermediate, DTYPE_BF16);
    else
        return 1;
    return 0;
}
