"""The reference of paged attention (kernels/paged_attention.py): the cache's blocks gathered and
widened to the queries' dtype, then PyTorch's SDPA, with the calls Hugging Face makes where they
apply so that those cases match it bit for bit. The CPU path runs it for prefills too."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import _triton
from kernels.kv_quant import KVFormat, from_cache, unscaled_format

# cuDNN's attention (torch 2.11 with CUDA 13.0, on an H200) ignores a per-request boolean mask on a
# few rows in bfloat16 and float16 at head_dim 128, so they attend to slots past their length: the
# masked reference calls leave it out (the kernels agree with a float64 softmax there, cuDNN does not)
_MASKED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, num_keys: int, kv_format: KVFormat, dtype: torch.dtype
) -> torch.Tensor:
    """Copy the first `num_keys` tokens of each row's blocks as values in `dtype` (a cache in
    another format widened): [rows, num_kv_heads, num_keys, head_dim]."""
    num_rows, (_, block_size, num_kv_heads, row) = block_tables.shape[0], cache.shape
    num_blocks = _triton.cdiv(num_keys, block_size)
    # index_select, not cache[table]: advanced indexing costs time in proportion to the whole cache
    kv = cache.index_select(0, block_tables[:, :num_blocks].reshape(-1))  # [rows * num_blocks, block_size, ...]
    kv = kv.view(num_rows, num_blocks * block_size, num_kv_heads, row)
    return from_cache(kv[:, :num_keys], kv_format, dtype).transpose(1, 2)


def _masked_sdpa(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, gqa: bool
) -> torch.Tensor:
    with sdpa_kernel(_MASKED_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _decode_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, kv_format: KVFormat,
) -> torch.Tensor:
    max_len = int(seq_lens.max())
    block_size = k_cache.shape[1]
    num_blocks = _triton.cdiv(max_len, block_size)
    # padding entries may hold anything; point them at block 0 so the gather stays in range
    blocks_used = (seq_lens + block_size - 1) // block_size  # [num_reqs]
    block_in_use = torch.arange(num_blocks, device=q.device)[None, :] < blocks_used[:, None]
    table = torch.where(block_in_use, block_tables[:, :num_blocks], 0)
    k = _gather_kv(k_cache, table, max_len, kv_format, q.dtype)  # [num_reqs, num_kv_heads, max_len, head_dim]
    v = _gather_kv(v_cache, table, max_len, kv_format, q.dtype)
    query = q[:, :, None, :]  # [num_reqs, num_heads, 1, head_dim]
    gqa = q.shape[1] != k_cache.shape[2]
    if int(seq_lens.min()) == max_len:
        # HF's own decode call (no mask), so equal-length batches match it bit for bit
        out = F.scaled_dot_product_attention(query, k, v, scale=scale, enable_gqa=gqa)
    else:
        valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]  # [num_reqs, max_len]
        # padded slots are masked out of the softmax, so their (finite) values get weight 0
        mask = valid[:, None, None, :]  # [num_reqs, 1, 1, max_len]
        out = _masked_sdpa(query, k, v, mask, scale, gqa)
    return out.squeeze(2)  # [num_reqs, num_heads, head_dim]


def extend_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, kv_format: KVFormat,
    out: torch.Tensor | None = None, min_query_len: int = 1,
) -> torch.Tensor:
    """Each request with at least `min_query_len` queries, one at a time, into `out` (new if None)."""
    out = torch.empty_like(q) if out is None else out
    starts = query_start_loc.tolist()
    gqa = q.shape[1] != k_cache.shape[2]
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len < max(min_query_len, 1):
            continue
        k = _gather_kv(k_cache, block_tables[i : i + 1], seq_len, kv_format, q.dtype)  # [1, kv_heads, seq_len, head_dim]
        v = _gather_kv(v_cache, block_tables[i : i + 1], seq_len, kv_format, q.dtype)
        query = q[q_start:q_end].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
        if q_len == 1 or q_len == seq_len:
            # HF's calls for a decode step and a fresh prompt, so those match it bit for bit
            o = F.scaled_dot_product_attention(query, k, v, is_causal=q_len > 1, scale=scale, enable_gqa=gqa)
        else:
            # bottom-right aligned: query j sits at position seq_len - q_len + j
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
            o = _masked_sdpa(query, k, v, mask, scale, gqa)
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
    kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """The cache widened to q's dtype (`kernels.kv_quant.from_cache`), then SDPA."""
    kv_format = kv_format or unscaled_format(k_cache.dtype)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if max_query_len == 1:
        return _decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, kv_format)
    return extend_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, kv_format)
