"""Random paged-attention batches with their dense K/V kept beside, for checking kernels."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels.kv_quant import KVFormat, from_cache, to_cache

# padding entries of a block table: far out of range, so reading one as a block id fails
PADDING_BLOCK_ID = 2**30


@dataclass(slots=True)
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    max_query_len: int
    scale: float
    dense_k: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim]
    dense_v: list[torch.Tensor]
    kv_format: KVFormat | None = None  # None: plain values of the caches' dtype

    @property
    def args(self) -> tuple[object, ...]:
        return (
            self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
            self.query_start_loc, self.max_query_len, self.scale, self.kv_format,
        )


def in_kv_format(batch: PagedBatch, fmt: KVFormat) -> PagedBatch:
    """The batch with its caches stored in `fmt`, and its dense K/V what that cache reads back as."""
    def stored(x: torch.Tensor) -> torch.Tensor:
        return from_cache(to_cache(x, fmt), fmt, x.dtype)

    return replace(
        batch, k_cache=to_cache(batch.k_cache, fmt), v_cache=to_cache(batch.v_cache, fmt), kv_format=fmt,
        dense_k=[stored(k) for k in batch.dense_k], dense_v=[stored(v) for v in batch.dense_v],
    )


POISON = 3.0e4


def make_paged_batch(
    seq_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
) -> PagedBatch:
    """Scatter random K/V over shuffled blocks of a cache filled with a huge finite value.

    Unwritten slots hold POISON and table padding is out of range, so any read of either that
    is not masked out shows. (Finite, as the paged_attention contract requires of unwritten slots.)
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, POISON, dtype=dtype)
    v_cache = torch.full(shape, POISON, dtype=dtype)
    # one spare column of padding past the longest request
    block_tables = torch.full((len(seq_lens), max(blocks_per_req) + 1), PADDING_BLOCK_ID, dtype=torch.int32)
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    dense_k, dense_v = [], []
    for i, (seq_len, num_req_blocks) in enumerate(zip(seq_lens, blocks_per_req, strict=True)):
        block_ids = torch.tensor([free_blocks.pop() for _ in range(num_req_blocks)], dtype=torch.int32)
        block_tables[i, :num_req_blocks] = block_ids
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        positions = torch.arange(seq_len)
        k_cache[block_ids[positions // block_size].long(), positions % block_size] = k
        v_cache[block_ids[positions // block_size].long(), positions % block_size] = v
        dense_k.append(k.to(device))
        dense_v.append(v.to(device))
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        block_tables=block_tables.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device), max_query_len=max(query_lens), scale=head_dim**-0.5,
        dense_k=dense_k, dense_v=dense_v,
    )


def dense_causal_attention(batch: PagedBatch) -> torch.Tensor:
    """Textbook softmax(q k^T * scale) v per request in float64, on the contiguous K/V."""
    num_heads = batch.q.shape[1]
    out = torch.empty(batch.q.shape, dtype=torch.float64, device=batch.q.device)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        q = batch.q[starts[i] : starts[i + 1]].double()  # [q_len, num_heads, head_dim]
        group = num_heads // batch.dense_k[i].shape[1]
        k = batch.dense_k[i].double().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = batch.dense_v[i].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out
