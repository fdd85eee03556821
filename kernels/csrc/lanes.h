/* Float vectors LANES wide (GCC vector extensions) and their loads and stores from float32 or
 * bfloat16 arrays, shared by the CPU attention kernels. LANES is 16 (one register) with
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

#endif
