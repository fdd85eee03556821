"""Causal attention of packed queries over a paged KV cache (decode and extend/prefill).

Request i's keys and values live in cache blocks named by its row of the block table:

    block_tables[i] = [ 7,  2,  9,  x,  x ]        (x: padding, never read)
                        |   |   |
    k_cache[7]  tokens  0 .. B-1
    k_cache[2]  tokens  B .. 2B-1
    k_cache[9]  tokens 2B .. seq_lens[i]-1, rest of the block unused

    token t -> k_cache[block_tables[i, t // B], t % B]          (B = block_size)

The q_len queries of request i are its last q_len positions, so query j sits at position
seq_lens[i] - q_len + j and sees keys 0 .. that position.
"""

from __future__ import annotations

import torch

from kernels import _triton, cpu_attention
from kernels._triton import jit, tl
from kernels.cpu_build import cpu_has_amx
from kernels.kv_quant import KVFormat, triton_constants, triton_load_rows, unscaled_format
from kernels.paged_attention_ref import extend_ref, paged_attention_ref

# Split-K decode: one program per (request, kv head, partition of the context) so that a
# few long requests still occupy every SM; a second kernel merges the partitions.
PARTITION_SIZE = 512
# Longer contexts get longer partitions rather than a partials buffer that grows with them.
MAX_PARTITIONS = 64
_LOG2E = 1.4426950408889634


@jit
def _load_kv(cache_ptr, rows, offs_d, mask, row_mask, HEAD_DIM: tl.constexpr, WIDEN: tl.constexpr,
             SCALED: tl.constexpr, KV: tl.constexpr, KV_MANT: tl.constexpr, KV_BIAS: tl.constexpr,
             KV_SUB_STEP: tl.constexpr):
    """Keys or values at cache element offsets `rows` [N]: as stored where the cache holds q's
    dtype, else widened to float32 (kernels/kv_quant.py)."""
    if WIDEN:
        return triton_load_rows(cache_ptr, rows, offs_d, mask, row_mask, HEAD_DIM, SCALED, KV, KV_MANT, KV_BIAS,
                                KV_SUB_STEP)
    return tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)


@jit
def _decode_partition_kernel(
    out_ptr, max_ptr, sum_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale,
    stride_out_r, stride_out_h, stride_out_p, stride_stats_r, stride_stats_h,
    stride_q_t, stride_q_h,
    stride_kc_b, stride_kc_t, stride_kc_h, stride_vc_b, stride_vc_t, stride_vc_h,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PARTITION: tl.constexpr,
    STORE_STATS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN: tl.constexpr, SCALED: tl.constexpr, KV: tl.constexpr, KV_MAX: tl.constexpr, KV_MANT: tl.constexpr,
    KV_BIAS: tl.constexpr, KV_SUB_STEP: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    start = part * PARTITION
    if start >= seq_len:
        return
    end = tl.minimum(start + PARTITION, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * QUERIES_PER_KV + offs_g
    g_mask = offs_g < QUERIES_PER_KV
    d_mask = offs_d < HEAD_DIM
    # decode: request i's single query is row i of q
    q = tl.load(
        q_ptr + req * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if WIDEN:  # a cache in another format is read as float32
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + req * stride_bt
    for start_n in range(start, end, TILE_N):
        offs_n = start_n + tl.arange(0, TILE_N)
        n_mask = offs_n < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        block_ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_offs = block_ids * stride_kc_b + in_block * stride_kc_t + kv_head * stride_kc_h
        k = _load_kv(k_cache_ptr, k_offs, offs_d, kv_mask, n_mask, HEAD_DIM, WIDEN, SCALED, KV, KV_MANT, KV_BIAS,
                     KV_SUB_STEP)  # [TILE_N, BLOCK_D]

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, TILE_N], log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_offs = block_ids * stride_vc_b + in_block * stride_vc_t + kv_head * stride_vc_h
        v = _load_kv(v_cache_ptr, v_offs, offs_d, kv_mask, n_mask, HEAD_DIM, WIDEN, SCALED, KV, KV_MANT, KV_BIAS,
                     KV_SUB_STEP)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    out_offs = req * stride_out_r + heads[:, None] * stride_out_h + part * stride_out_p + offs_d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if STORE_STATS:
        stats_offs = req * stride_stats_r + heads * stride_stats_h + part
        tl.store(max_ptr + stats_offs, m_i, mask=g_mask)
        tl.store(sum_ptr + stats_offs, l_i, mask=g_mask)


@jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, max_ptr, sum_ptr, seq_lens_ptr,
    stride_out_t, stride_out_h, stride_part_r, stride_part_h, stride_part_p, stride_stats_r, stride_stats_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PARTITION: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_parts = tl.cdiv(tl.load(seq_lens_ptr + req), PARTITION)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    stats = req * stride_stats_r + head * stride_stats_h
    parts = part_out_ptr + req * stride_part_r + head * stride_part_h + offs_d
    m_total = tl.load(max_ptr + stats)
    l_total = tl.load(sum_ptr + stats)
    acc = tl.load(parts, mask=d_mask, other=0.0) * l_total  # [BLOCK_D], unnormalised
    for part in range(1, num_parts):
        part_max = tl.load(max_ptr + stats + part)
        part_sum = tl.load(sum_ptr + stats + part)
        m_new = tl.maximum(m_total, part_max)
        old_scale = tl.exp2(m_total - m_new)
        new_scale = tl.exp2(part_max - m_new) * part_sum
        acc = acc * old_scale + tl.load(parts + part * stride_part_p, mask=d_mask, other=0.0) * new_scale
        l_total = l_total * old_scale + new_scale
        m_total = m_new
    out = acc / l_total
    tl.store(out_ptr + req * stride_out_t + head * stride_out_h + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@jit
def _extend_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale,
    stride_out_t, stride_out_h, stride_q_t, stride_q_h,
    stride_kc_b, stride_kc_t, stride_kc_h, stride_vc_b, stride_vc_t, stride_vc_h,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN: tl.constexpr, SCALED: tl.constexpr, KV: tl.constexpr, KV_MAX: tl.constexpr, KV_MANT: tl.constexpr,
    KV_BIAS: tl.constexpr, KV_SUB_STEP: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len
    kv_head = head // QUERIES_PER_KV
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if WIDEN:  # a cache in another format is read as float32
        q = q.to(tl.float32)
    q_pos = context_len + offs_m
    # the last query of this tile sees nothing past its own position
    kv_end = tl.minimum(seq_len, context_len + (m_block + 1) * BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + req * stride_bt
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        block_ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_offs = block_ids * stride_kc_b + in_block * stride_kc_t + kv_head * stride_kc_h
        k = _load_kv(k_cache_ptr, k_offs, offs_d, kv_mask, n_mask, HEAD_DIM, WIDEN, SCALED, KV, KV_MANT, KV_BIAS,
                     KV_SUB_STEP)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        # key 0 is visible to every row, so no row is all -inf after the first tile
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_offs = block_ids * stride_vc_b + in_block * stride_vc_t + kv_head * stride_vc_h
        v = _load_kv(v_cache_ptr, v_offs, offs_d, kv_mask, n_mask, HEAD_DIM, WIDEN, SCALED, KV, KV_MANT, KV_BIAS,
                     KV_SUB_STEP)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    out_offs = q_rows[:, None] * stride_out_t + head * stride_out_h + offs_d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _check_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, kv_format: KVFormat,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != kv_format.row_elements(head_dim):
        raise ValueError(f"cache rows of {k_cache.shape[3]} do not hold q's head_dim {head_dim} in {kv_format.name}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if not k_cache.dtype == v_cache.dtype == kv_format.storage_dtype:
        raise ValueError(f"a {kv_format.name} cache is stored as {kv_format.storage_dtype}, got k_cache "
                         f"{k_cache.dtype} and v_cache {v_cache.dtype}")
    num_reqs = seq_lens.shape[0]
    for name, t, shape in (
        ("seq_lens", seq_lens, (num_reqs,)),
        ("query_start_loc", query_start_loc, (num_reqs + 1,)),
        ("block_tables", block_tables, (num_reqs, block_tables.shape[-1])),
    ):
        if t.dtype != torch.int32 or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be int32 {list(shape)}, got {t.dtype} {list(t.shape)}")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be at least 1, got {max_query_len}")
    if max_query_len == 1 and num_tokens != num_reqs:
        raise ValueError(f"a decode batch (max_query_len 1) needs one query per request: {num_tokens} != {num_reqs}")


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 stays fp32: tf32 would cost the ~1e-5 agreement with the reference
    return "ieee" if dtype == torch.float32 else "tf32"


def _format_meta(q: torch.Tensor, kv_format: KVFormat) -> dict[str, object]:
    return {"WIDEN": kv_format.dtype != q.dtype, **triton_constants(kv_format)}


def _decode_triton(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, partition_size: int, kv_format: KVFormat,
) -> None:
    num_reqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    partition = max(partition_size, _triton.next_power_of_2(_triton.cdiv(max_context, MAX_PARTITIONS)))
    num_parts = _triton.cdiv(max_context, partition)
    meta = dict(
        QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim,
        BLOCK_G=max(16, _triton.next_power_of_2(queries_per_kv)), BLOCK_D=max(16, _triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, TILE_N=64, PARTITION=partition, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=4, num_stages=2, **_format_meta(q, kv_format),
    )
    grid = (num_reqs, num_kv_heads, num_parts)
    common = (q, k_cache, v_cache, block_tables, seq_lens, scale * _LOG2E)
    strides = (q.stride(0), q.stride(1), *_cache_strides(k_cache, v_cache), block_tables.stride(0))
    if num_parts == 1:
        # one partition is already the answer: write it straight to `out`
        _triton.launch(
            _decode_partition_kernel, grid, out, out, out, *common,
            out.stride(0), out.stride(1), 0, 0, 0, *strides, STORE_STATS=False, **meta,
        )
        return
    part_out = torch.empty((num_reqs, num_heads, num_parts, head_dim), dtype=torch.float32, device=q.device)
    part_max = torch.empty((num_reqs, num_heads, num_parts), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    _triton.launch(
        _decode_partition_kernel, grid, part_out, part_max, part_sum, *common,
        *part_out.stride()[:3], *part_max.stride()[:2], *strides, STORE_STATS=True, **meta,
    )
    _triton.launch(
        _decode_reduce_kernel, (num_reqs, num_heads),
        out, part_out, part_max, part_sum, seq_lens,
        out.stride(0), out.stride(1), *part_out.stride()[:3], *part_max.stride()[:2],
        HEAD_DIM=head_dim, BLOCK_D=meta["BLOCK_D"], PARTITION=partition, num_warps=1,
    )


def _extend_triton(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float, kv_format: KVFormat,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_reqs = seq_lens.shape[0]
    block_d = max(16, _triton.next_power_of_2(head_dim))
    # fp32 tiles take twice the shared memory: halve the query tile to stay within Hopper's 227 KiB
    block_m = 128 if q.element_size() <= 2 and block_d <= 128 else 64
    _triton.launch(
        _extend_kernel, (num_reqs, num_heads, _triton.cdiv(max_query_len, block_m)),
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale * _LOG2E,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1), *_cache_strides(k_cache, v_cache),
        block_tables.stride(0),
        QUERIES_PER_KV=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=64, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=8 if block_m == 128 else 4, num_stages=2, **_format_meta(q, kv_format),
    )


def paged_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
    kv_format: KVFormat | None = None, partition_size: int = PARTITION_SIZE,
) -> torch.Tensor:
    kv_format = kv_format or unscaled_format(k_cache.dtype)
    _check_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, kv_format)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    if partition_size < 64 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 64, got {partition_size}")
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    if max_query_len == 1:
        _decode_triton(out, q, k_cache, v_cache, block_tables, seq_lens, scale, partition_size, kv_format)
    else:
        _extend_triton(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
                       kv_format)
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
    kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """Causal attention for packed queries q [num_tokens, num_heads, head_dim] over a paged cache.

    Request i owns q rows query_start_loc[i]:query_start_loc[i+1], the last positions of its
    seq_lens[i] tokens, whose K/V must already be in the cache. `max_query_len` (host int) is
    the longest of those row ranges; 1 selects the decode path. Returns [num_tokens,
    num_heads, head_dim] in q's dtype. Cache slots past a request's length must hold finite
    values (the engine zero-initialises its pool): the CPU reference reads and masks them
    rather than spending a pass on zeroing them.

    On CUDA this runs the Triton kernels; on the CPU, float32 and bfloat16 requests run the C
    kernels of `kernels.cpu_attention` (prefill rows the reference's SDPA where
    `sdpa_prefills_faster`), and other dtypes `paged_attention_ref`. The reference
    matches Hugging Face's SDPA attention bit for bit on equal-length decode batches and fresh
    prompts, and to float rounding elsewhere (padding changes SDPA's vector tails). The C
    kernel agrees with it to float rounding in float32 (about 1e-6); in bfloat16 it keeps
    float32 until it rounds the output, so it is within one bf16 ulp of the float32 result.

    `kv_format` (`kernels.kv_quant`) says how the cache stores its values; by default as plain
    values of the cache's dtype. Every path widens it as it reads: the reference to q's dtype
    before SDPA, the kernels to float32.
    """
    kv_format = kv_format or unscaled_format(k_cache.dtype)
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, kv_format)
    if q.is_cuda:
        return paged_attention_triton(*args)
    _check_args(*args[:-2], kv_format)
    if q.shape[0] and cpu_attention.supports(q, k_cache):
        return paged_attention_cpu(*args)
    return paged_attention_ref(*args)


def sdpa_prefills_faster(dtype: torch.dtype, kv_format: KVFormat) -> bool:
    """Whether the reference's per-request SDPA beats the C prefill kernel here: a bf16 query and
    cache on a CPU with AMX, where torch's flash attention multiplies on the tile unit and the
    kernel on AVX512-BF16's dot products. On two Sapphire Rapids cores, 9 query heads on 3 kv
    heads, a layer: one 2,048-token prompt 31 -> 8.6 ms, 8 x 256 tokens 5.4 -> 2.4 ms, 512 tokens
    after 1,536 cached 13.3 -> 4.5 ms; only 32 x 64 tokens was slower (2.2 -> 2.6 ms, a Python
    loop over the requests). Not in float32 (the kernel was 1.1-1.8x faster there)."""
    return dtype == torch.bfloat16 and kv_format == unscaled_format(torch.bfloat16) and cpu_has_amx()


def paged_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
    kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """On the CPU: one-query (decode) requests run the decode kernel, longer ones (prefill
    chunks) the prefill kernel, both reading the cache in place; the reference where the
    prefill kernel is not built or where `sdpa_prefills_faster`."""
    kv_format = kv_format or unscaled_format(k_cache.dtype)
    if max_query_len == 1:
        return cpu_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, kv_format)
    out = torch.empty_like(q)
    query_lens = query_start_loc.diff()
    decoding = (query_lens == 1).nonzero().squeeze(1)
    if decoding.numel():
        rows = query_start_loc[decoding].long()
        out[rows] = cpu_attention.paged_decode_attention(
            q[rows], k_cache, v_cache, block_tables[decoding], seq_lens[decoding], scale, kv_format
        )
    if cpu_attention.prefill_supported(q, k_cache) and not sdpa_prefills_faster(q.dtype, kv_format):
        return cpu_attention.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, min_query_len=2,
            kv_format=kv_format,
        )
    return extend_ref(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, kv_format, out=out, min_query_len=2
    )
