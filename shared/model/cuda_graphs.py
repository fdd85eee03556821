"""CUDA graphs for the decode step: one capture per common batch size, replayed with padding.

A decode step launches hundreds of small kernels; on a GPU their launch overhead rivals the
work. Capturing the whole forward once per batch size and replaying it removes that. The
graphs read from static input buffers, so a step copies its inputs into them first; rows past
the real batch point at a scratch block that no request owns, so their writes are harmless.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels.kv_quant import KVFormat
from shared.model.llama import AttentionMetadata, LlamaModel

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(slots=True)
class _StaticInputs:
    input_ids: torch.Tensor  # int64 [max_bs]
    positions: torch.Tensor  # int64 [max_bs]
    slot_mapping: torch.Tensor  # int64 [max_bs]
    block_tables: torch.Tensor  # int32 [max_bs, max_blocks_per_req]
    seq_lens: torch.Tensor  # int32 [max_bs]
    query_start_loc: torch.Tensor  # int32 [max_bs + 1], fixed at arange: one query per request


class DecodeGraphs:
    def __init__(
        self, model: LlamaModel, kv_cache: torch.Tensor, kv_format: KVFormat, scratch_block: int, max_blocks_per_req: int,
        max_batch_size: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_format = kv_format
        self.block_size = kv_cache.shape[3]
        self.scratch_block = scratch_block
        self.batch_sizes = [b for b in DEFAULT_BATCH_SIZES if b <= max_batch_size]
        max_bs = self.batch_sizes[-1]
        device = model.device
        self.inputs = _StaticInputs(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_bs,), scratch_block * self.block_size, dtype=torch.int64, device=device),
            block_tables=torch.full((max_bs, max_blocks_per_req), scratch_block, dtype=torch.int32, device=device),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
        )
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def capture(self) -> None:
        # largest first, so smaller graphs reuse its memory pool
        for bs in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            self._forward(bs)  # warm up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self._forward(bs)
            self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def _forward(self, bs: int) -> torch.Tensor:
        s = self.inputs
        meta = AttentionMetadata(
            slot_mapping=s.slot_mapping[:bs], block_tables=s.block_tables[:bs], seq_lens=s.seq_lens[:bs],
            query_start_loc=s.query_start_loc[: bs + 1], max_query_len=1,
        )
        return self.model.forward(s.input_ids[:bs], s.positions[:bs], meta, self.kv_cache, self.kv_format)

    def can_run(self, num_reqs: int, max_query_len: int, num_table_blocks: int) -> bool:
        return (max_query_len == 1 and num_reqs <= self.max_batch_size
                and num_table_blocks <= self.inputs.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the smallest captured graph that fits; returns hidden states [num_reqs, hidden]."""
        n = input_ids.shape[0]
        bs = next(b for b in self.batch_sizes if b >= n)
        s = self.inputs
        s.input_ids[:n].copy_(input_ids)
        s.positions[:n].copy_(positions)
        s.slot_mapping[:n].copy_(meta.slot_mapping)
        s.slot_mapping[n:bs].fill_(self.scratch_block * self.block_size)
        s.block_tables[:bs].fill_(self.scratch_block)
        s.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        s.seq_lens[:n].copy_(meta.seq_lens)
        s.seq_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
