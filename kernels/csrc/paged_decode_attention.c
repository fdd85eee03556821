/* Decode attention over a paged KV cache, for the CPU, reading the cache blocks in place.
 *
 * The PyTorch reference gathers every request's blocks into a contiguous copy before
 * scaled_dot_product_attention reads it again; at batch 64 that copy is a quarter of a
 * decode step. Here each (request, kv head) pair walks its block table once for the keys and
 * once for the values, so the cache is read twice and written never.
 *
 * Softmax is two-pass (scores, then max/exp/sum) in float32, as in the reference. One OpenMP
 * work item per (request, kv head); the query heads of a GQA group share each key and value
 * load. head_dim 64 and 128 get their own copies with the size known to the compiler, so
 * each head's row is a fixed run of vector registers. Built and loaded by
 * kernels/cpu_attention.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float *out;
    int64_t out_stride_r, out_stride_h;
    const float *q;
    int64_t q_stride_r, q_stride_h;
    const float *k_cache;
    int64_t kc_stride_b, kc_stride_t, kc_stride_h;
    const float *v_cache;
    int64_t vc_stride_b, vc_stride_t, vc_stride_h;
    const int32_t *block_tables;
    int64_t bt_stride;
    const int32_t *seq_lens;
    int32_t num_reqs, num_heads, num_kv_heads, head_dim, block_size, max_seq_len;
    float scale;
} DecodeArgs;

/* One (request, kv head): scores [group, len] and acc [group, head_dim] are scratch. */
static inline __attribute__((always_inline)) void attend(
    const DecodeArgs *a, int32_t r, int32_t g, const int head_dim, float *restrict scores, float *restrict acc)
{
    const int group = a->num_heads / a->num_kv_heads;
    const int32_t len = a->seq_lens[r];
    const int32_t bs = a->block_size;
    const int32_t *table = a->block_tables + r * a->bt_stride;
    const float *q_group = a->q + r * a->q_stride_r + (int64_t)g * group * a->q_stride_h;

    for (int32_t t0 = 0; t0 < len; t0 += bs) {
        const float *k_block = a->k_cache + (int64_t)table[t0 / bs] * a->kc_stride_b + g * a->kc_stride_h;
        const int32_t n = len - t0 < bs ? len - t0 : bs;
        for (int j = 0; j < group; j++) {
            const float *restrict qh = q_group + j * a->q_stride_h;
            float *restrict s = scores + (int64_t)j * len + t0;
            for (int32_t i = 0; i < n; i++) {
                const float *restrict k = k_block + i * a->kc_stride_t;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < head_dim; d++)
                    dot += qh[d] * k[d];
                s[i] = dot * a->scale;
            }
        }
    }

    for (int j = 0; j < group; j++) {
        float *restrict s = scores + (int64_t)j * len;
        float max = s[0];
        for (int32_t t = 1; t < len; t++)
            max = s[t] > max ? s[t] : max;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int32_t t = 0; t < len; t++) {
            s[t] = expf(s[t] - max);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int32_t t = 0; t < len; t++)
            s[t] *= inv;
    }

    memset(acc, 0, sizeof(float) * (size_t)group * (size_t)head_dim);
    for (int32_t t0 = 0; t0 < len; t0 += bs) {
        const float *v_block = a->v_cache + (int64_t)table[t0 / bs] * a->vc_stride_b + g * a->vc_stride_h;
        const int32_t n = len - t0 < bs ? len - t0 : bs;
        for (int j = 0; j < group; j++) {
            const float *restrict p = scores + (int64_t)j * len + t0;
            float *restrict accj = acc + j * head_dim;
            for (int32_t i = 0; i < n; i++) {
                const float *restrict v = v_block + i * a->vc_stride_t;
#pragma omp simd
                for (int d = 0; d < head_dim; d++)
                    accj[d] += p[i] * v[d];
            }
        }
    }

    for (int j = 0; j < group; j++) {
        float *o = a->out + r * a->out_stride_r + ((int64_t)g * group + j) * a->out_stride_h;
        memcpy(o, acc + j * head_dim, sizeof(float) * (size_t)head_dim);
    }
}

static void attend_64(const DecodeArgs *a, int32_t r, int32_t g, float *scores, float *acc)
{
    attend(a, r, g, 64, scores, acc);
}

static void attend_128(const DecodeArgs *a, int32_t r, int32_t g, float *scores, float *acc)
{
    attend(a, r, g, 128, scores, acc);
}

static void attend_any(const DecodeArgs *a, int32_t r, int32_t g, float *scores, float *acc)
{
    attend(a, r, g, a->head_dim, scores, acc);
}

/* Returns 0, or 1 when a thread could not allocate its scratch (nothing is then computed). */
int paged_decode_attention_f32(
    float *out, int64_t out_stride_r, int64_t out_stride_h,
    const float *q, int64_t q_stride_r, int64_t q_stride_h,
    const float *k_cache, int64_t kc_stride_b, int64_t kc_stride_t, int64_t kc_stride_h,
    const float *v_cache, int64_t vc_stride_b, int64_t vc_stride_t, int64_t vc_stride_h,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    int32_t num_reqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
    int32_t max_seq_len, float scale)
{
    const DecodeArgs args = {
        out, out_stride_r, out_stride_h, q, q_stride_r, q_stride_h,
        k_cache, kc_stride_b, kc_stride_t, kc_stride_h, v_cache, vc_stride_b, vc_stride_t, vc_stride_h,
        block_tables, bt_stride, seq_lens, num_reqs, num_heads, num_kv_heads, head_dim, block_size,
        max_seq_len, scale,
    };
    void (*kernel)(const DecodeArgs *, int32_t, int32_t, float *, float *) =
        head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any;
    const int group = num_heads / num_kv_heads;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)max_seq_len);
        float *acc = malloc(sizeof(float) * (size_t)group * (size_t)head_dim);
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for collapse(2) schedule(dynamic, 1)
            for (int32_t r = 0; r < num_reqs; r++)
                for (int32_t g = 0; g < num_kv_heads; g++)
                    kernel(&args, r, g, scores, acc);
        }
        free(scores);
        free(acc);
    }
    return failed;
}
