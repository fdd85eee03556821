/* Float vectors LANES wide (GCC vector extensions) and their loads and stores from float32 or
 * bfloat16 arrays, and loads from every KV cache format (load_kv_lanes), shared by the CPU
 * attention kernels. LANES is 16 (one register) with
 * AVX-512, else 8 (one AVX2 register, two NEON ones). */
#ifndef LLMD_LANES_H
#define LLMD_LANES_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif

typedef float vfloat __attribute__((vector_size(4 * LANES)));
typedef uint32_t vuint __attribute__((vector_size(4 * LANES)));
typedef int32_t vint __attribute__((vector_size(4 * LANES)));
typedef uint16_t vhalf __attribute__((vector_size(2 * LANES)));

/* Elements i .. i+LANES-1 of a float32 (bf16 == 0) or bfloat16 (bf16 == 1) array, as floats. */
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

/* The KV cache formats (kernels/kv_quant.py, KVFormat.code). The 8-bit ones store a row as
 * head_dim codes followed by its float32 scale (kv_row_scale). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_E4M3 = 3, KV_E5M2 = 4, KV_I8 = 5 };

/* Bytes one stored value of a format takes. */
static inline __attribute__((always_inline)) int kv_size(const int kv)
{
    return kv == KV_F32 ? 4 : kv <= KV_F16 ? 2 : 1;
}

/* A row's scale: the float32 after its head_dim codes in the 8-bit formats, 1 otherwise. */
static inline __attribute__((always_inline)) float kv_row_scale(const void *row, int head_dim, const int kv)
{
    float scale = 1.0f;
    if (kv >= KV_E4M3)
        memcpy(&scale, (const uint8_t *)row + head_dim, sizeof scale);
    return scale;
}

typedef uint8_t vbyte __attribute__((vector_size(LANES)));
typedef int8_t vsbyte __attribute__((vector_size(LANES)));

/* Small floats (float16, fp8) with `mant` mantissa bits and exponent bias `bias`, their bits
 * in the low `sign_bit + 1` bits of each lane, as float32. A normal number's exponent and
 * mantissa move up into float32's fields with the bias changed; a subnormal (exponent field 0)
 * is its mantissa times the smallest subnormal step, exact in float32. No infinities or NaNs
 * reach here: the writers clamp to the format's range. */
static inline __attribute__((always_inline)) vfloat small_float_lanes(vint bits, const int mant, const int bias,
                                                                      const int sign_bit)
{
    const vint magnitude = bits & ((1 << sign_bit) - 1);
    const vint normal = (magnitude << (23 - mant)) + ((127 - bias) << 23);
    const vfloat subnormal = __builtin_convertvector(magnitude, vfloat) *
                             __builtin_ldexpf(1.0f, 1 - bias - mant);
    vint subnormal_bits;
    memcpy(&subnormal_bits, &subnormal, sizeof subnormal_bits);
    const vint is_subnormal = (magnitude >> mant) == 0;
    const vint out = (is_subnormal & subnormal_bits) | (~is_subnormal & normal) | ((bits >> sign_bit) << 31);
    vfloat v;
    memcpy(&v, &out, sizeof v);
    return v;
}

/* Elements i .. i+LANES-1 of a cache row in format kv, as floats, before its scale. */
static inline __attribute__((always_inline)) vfloat load_kv_lanes(const void *row, int64_t i, const int kv)
{
    if (kv == KV_F32 || kv == KV_BF16)
        return load_lanes(row, i, kv == KV_BF16);
    if (kv == KV_F16) {
        vhalf h;
        memcpy(&h, (const uint16_t *)row + i, sizeof h);
        return small_float_lanes(__builtin_convertvector(h, vint), 10, 15, 15);
    }
    if (kv == KV_I8) {
        vsbyte b;
        memcpy(&b, (const int8_t *)row + i, sizeof b);
        return __builtin_convertvector(b, vfloat);
    }
    vbyte b;
    memcpy(&b, (const uint8_t *)row + i, sizeof b);
    return kv == KV_E4M3 ? small_float_lanes(__builtin_convertvector(b, vint), 3, 7, 7)
                         : small_float_lanes(__builtin_convertvector(b, vint), 2, 15, 7);
}

#endif
