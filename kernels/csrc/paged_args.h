/* The arguments both CPU attention kernels take: the queries, the output and the paged KV
 * cache. A row is a request's one query in decode, a token's in prefill. The cache strides
 * count its stored elements (bytes in the 8-bit formats, whose rows end in their scale). */
#ifndef LLMD_PAGED_ARGS_H
#define LLMD_PAGED_ARGS_H

#include <stdint.h>

typedef struct {
    void *out;
    int64_t out_stride_r, out_stride_h;
    const void *q;
    int64_t q_stride_r, q_stride_h;
    const void *k_cache;
    int64_t kc_stride_b, kc_stride_t, kc_stride_h;
    const void *v_cache;
    int64_t vc_stride_b, vc_stride_t, vc_stride_h;
    const int32_t *block_tables;
    int64_t bt_stride;
    const int32_t *seq_lens;
    const int32_t *query_start_loc; /* prefill: request i's rows are query_start_loc[i] .. [i + 1] - 1 */
    int32_t num_reqs, num_heads, num_kv_heads, head_dim, block_size, max_seq_len;
    float scale;
    int32_t kv; /* the cache's format, KV_* of lanes.h */
} PagedArgs;

#endif
