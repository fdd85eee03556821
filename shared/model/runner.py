"""Owns the device tensors (weights, the paged KV pool) and turns a scheduled batch into sampled tokens."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels import cpu_attention, cpu_layer_ops, gumbel_argmax
from kernels.kv_quant import KVFormat, unscaled_format
from shared.engine.sampler import Sampler, SamplingInput, build_sampling_batch
from shared.engine.scheduler import ScheduledBatch, StepResult
from shared.engine.step_phases import FORWARD, LOGITS, PREPARE, SAMPLE, StepPhases
from shared.model.config import ModelConfig
from shared.model.cuda_graphs import DecodeGraphs
from shared.model.greedy_head import GreedyHead
from shared.model.huge_pages import huge_zeros
from shared.model.llama import AttentionMetadata, LlamaModel

logger = logging.getLogger(__name__)



# the fewest rows a chunk of greedy logits takes: fewer would only add calls
GREEDY_MIN_CHUNK_ROWS = 16


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampling_reqs]: last token row of each sampling request


def kv_block_bytes(config: ModelConfig, block_size: int, kv_format: KVFormat | torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values (an 8-bit format's scales included);
    a dtype stands for plain values of it."""
    fmt = kv_format if isinstance(kv_format, KVFormat) else unscaled_format(kv_format)
    return config.num_layers * 2 * block_size * config.num_kv_heads * fmt.row_bytes(config.head_dim)


class ModelRunner:
    def __init__(
        self, model: LlamaModel, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
        kv_format: KVFormat | None = None, phases: StepPhases | None = None,
    ) -> None:
        cfg = model.config
        self.model = model
        self.phases = phases or StepPhases()
        self.block_size = block_size
        self.kv_format = kv_format or unscaled_format(model.dtype)
        self.sampler = Sampler()
        # a plain greedy batch wider than this never holds its whole logits (`_wide_greedy`): as many rows as
        # hold the LM head's bytes in float32 logits, beyond which the logits outweigh the weight (on the
        # CPU: a GPU's logits stay in its memory anyway)
        vocab_row_bytes = 4 * cfg.vocab_size
        self.greedy_chunk_rows = (max(GREEDY_MIN_CHUNK_ROWS, model.lm_head.num_bytes() // vocab_row_bytes)
                                  if model.device.type == "cpu" else sys.maxsize)
        self.greedy_head = GreedyHead.for_model(model)
        use_graphs = model.device.type == "cuda"
        # zeros, not empty: attention masks padding slots, and 0 * garbage-NaN would still be NaN.
        # On CUDA one extra block, owned by no request, absorbs the padded rows of graph replays.
        # an 8-bit format's rows are bytes: head_dim codes, then the row's scale (kernels/kv_quant.py)
        row = self.kv_format.row_elements(cfg.head_dim)
        self.kv_cache = huge_zeros(
            (cfg.num_layers, 2, num_blocks + int(use_graphs), block_size, cfg.num_kv_heads, row),
            self.kv_format.storage_dtype, model.device,
        )
        logger.info(
            "KV pool: %d blocks of %d tokens (%.1f MiB, %s)",
            num_blocks, block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**20, self.kv_format.name,
        )
        if model.device.type == "cpu":
            # build the C kernels (a first start compiles them, ~20 s on 2 cores) while the worker loads,
            # not inside its first request
            for load in (cpu_layer_ops.load, cpu_attention.load, cpu_attention.load_prefill, gumbel_argmax.load):
                load()
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            self.graphs = DecodeGraphs(model, self.kv_cache, self.kv_format, num_blocks, -(-max_model_len // block_size),
                                       max_num_seqs)
            self.graphs.capture()

    @property
    def device(self) -> torch.device:
        return self.model.device

    def execute(self, batch: ScheduledBatch) -> StepResult:
        phases = self.phases
        inputs = self.prepare_inputs(batch)
        meta = inputs.meta
        phases.lap(PREPARE)
        if self.graphs is not None and self.graphs.can_run(len(batch.reqs), meta.max_query_len, meta.block_tables.shape[1]):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, meta)
        else:
            hidden = self.model.forward(inputs.input_ids, inputs.positions, meta, self.kv_cache, self.kv_format)
        phases.lap(FORWARD)
        sampling_reqs = [req for i, req in enumerate(batch.reqs) if batch.samples(i)]
        if not sampling_reqs:
            return StepResult(token_ids=[])
        rows = [SamplingInput(r.params, r.seed, r.prompt_token_ids, r.output_token_ids) for r in sampling_reqs]
        vocab_size = self.model.config.vocab_size
        masks = None
        if any(r.grammar is not None for r in sampling_reqs):
            # xgrammar loads with the first constrained request, not at a worker's start
            from shared.engine.structured import token_masks

            masks = token_masks([r.grammar for r in sampling_reqs], vocab_size)
        sampling = build_sampling_batch(rows, sampling_reqs[0].eos_token_ids, vocab_size, self.device, masks)
        last_hidden = hidden[inputs.logits_indices]
        if sampling.is_plain_greedy and len(sampling_reqs) > self.greedy_chunk_rows:
            token_ids = self._wide_greedy(last_hidden)
            phases.lap(LOGITS)
            return StepResult(token_ids=token_ids)
        logits = self.model.compute_logits(last_hidden)  # [num_sampling_reqs, vocab]
        phases.lap(LOGITS)
        out = self.sampler(logits, sampling)
        phases.lap(SAMPLE)
        return StepResult(token_ids=out.token_ids, logprobs=out.logprobs, top_logprobs=out.top_logprobs)

    def _wide_greedy(self, last_hidden: torch.Tensor) -> list[int]:
        """Greedy tokens of a batch too wide for its logits to stay in cache: without the logits where
        the model allows (shared/model/greedy_head.py), else the LM head and the argmax
        `greedy_chunk_rows` rows at a time. With a 49k vocabulary 256 rows' logits are 50 MB; a
        2-layer model of hidden size 64 took 49 ms for its LM head and argmax over them on 2 cores,
        31 ms in chunks of 64 rows."""
        if self.greedy_head is not None:
            return self.greedy_head.greedy(last_hidden)
        step = self.greedy_chunk_rows
        return [token for start in range(0, last_hidden.shape[0], step)
                for token in self.sampler.greedy(self.model.compute_logits(last_hidden[start:start + step]))]

    def prepare_inputs(self, batch: ScheduledBatch) -> ModelInput:
        # Built in numpy, then one tensor per input: every torch call lets go of the GIL, and the
        # engine thread may wait for the event loop to hand it back after each (see
        # services/runtime/engine_thread.py); on an H200 building a decode step's inputs took most of the
        # engine thread's time when it was a dozen torch calls plus one per request.
        num_reqs = len(batch.reqs)
        token_ids: list[int] = []
        for req, num_new in zip(batch.reqs, batch.num_new_tokens):
            token_ids.extend(req.token_ids[req.num_computed_tokens : req.num_computed_tokens + num_new])
        num_new_tokens = np.array(batch.num_new_tokens, dtype=np.int64)
        starts = np.fromiter((req.num_computed_tokens for req in batch.reqs), dtype=np.int64, count=num_reqs)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_new_tokens, out=query_start_loc[1:])
        req_index = np.repeat(np.arange(num_reqs), num_new_tokens)  # [num_tokens]
        positions = np.arange(len(token_ids)) - (query_start_loc[:-1] - starts)[req_index]
        block_tables = _pad_block_tables(batch.block_tables)
        slot_mapping = block_tables[req_index, positions // self.block_size].astype(np.int64) * self.block_size + (
            positions % self.block_size
        )
        sampling_rows = np.fromiter((i for i in range(num_reqs) if batch.samples(i)), dtype=np.int64)
        device = self.device

        def on_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        meta = AttentionMetadata(
            slot_mapping=on_device(slot_mapping),
            block_tables=on_device(block_tables),
            seq_lens=on_device((starts + num_new_tokens).astype(np.int32)),
            query_start_loc=on_device(query_start_loc.astype(np.int32)),
            max_query_len=max(batch.num_new_tokens),
        )
        return ModelInput(
            input_ids=on_device(np.array(token_ids, dtype=np.int64)),
            positions=on_device(positions),
            meta=meta,
            logits_indices=on_device(query_start_loc[1:][sampling_rows] - 1),
        )

    # Both copies run on a helper thread while a step runs. On the CPU they copy through numpy, one
    # block at a time: a torch op there would start a second OpenMP team in the process, and from
    # then on libgomp (more threads than CPUs) all but stops spin-waiting between parallel regions,
    # which made every later decode step 2-3x slower.
    def read_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """KV of the given blocks, [num_blocks, num_layers, 2, block_size, num_kv_heads, row] on the CPU, as the
        pool stores them (an 8-bit format's rows are bytes with their scales, so a block's bytes carry
        everything needed to read it): into `out` (contiguous, that shape and the pool's dtype) where given,
        else a new tensor."""
        shape = self.blocks_shape(len(block_ids))
        if out is not None and (tuple(out.shape) != shape or out.dtype != self.kv_cache.dtype
                                or out.device.type != "cpu" or not out.is_contiguous()):
            raise ValueError(f"KV block buffer is {out.dtype}{list(out.shape)} on {out.device}, expected a contiguous "
                             f"{self.kv_cache.dtype}{list(shape)} on the CPU")
        if self.device.type != "cpu":
            index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            blocks = self.kv_cache.index_select(2, index).movedim(2, 0)
            return blocks.contiguous().cpu() if out is None else out.copy_(blocks)
        out = torch.empty(shape, dtype=self.kv_cache.dtype) if out is None else out
        pool, dst = _bits(self.kv_cache), _bits(out)
        for i, block in enumerate(block_ids):
            dst[i] = pool[:, :, block]
        return out

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        expected = self.blocks_shape(len(block_ids))
        if tuple(data.shape) != expected:
            raise ValueError(f"KV block data has shape {tuple(data.shape)}, expected {expected}")
        if data.dtype != self.kv_cache.dtype:  # converting would pass off another format's bytes as this one's
            raise ValueError(f"KV block data is {data.dtype}, the pool stores {self.kv_format.name} as "
                             f"{self.kv_cache.dtype}")
        if self.device.type != "cpu":
            index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            self.kv_cache.index_copy_(2, index, data.to(device=self.device).movedim(0, 2))
            return
        pool, src = _bits(self.kv_cache), _bits(data)
        for i, block in enumerate(block_ids):
            pool[:, :, block] = src[i]

    def block_views(self, block_ids: list[int]) -> list[memoryview] | None:
        """The pool's own bytes of these blocks, writable, in the order `read_blocks` lays them
        out (block, then layer, then K and V); None where the pool is not in host memory. A
        transport sends from them or receives into them with no copy; the rules of
        `Engine.read_blocks` and `Engine.write_blocks` apply."""
        return self._segments(block_ids, range(self.kv_cache.shape[0]))

    def layer_views(self, block_ids: list[int], layer: int) -> list[memoryview] | None:
        """Of `block_views`, only `layer`'s: per block its K then its V bytes."""
        return self._segments(block_ids, (layer,))

    def _segments(self, block_ids: list[int], layers: Sequence[int]) -> list[memoryview] | None:
        flat = self.pool_view()
        if flat is None:
            return None
        # pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: one block of one
        # layer's K or V is `segment` contiguous bytes
        num_layers, _, num_pool_blocks = self.kv_cache.shape[:3]
        segment = len(flat) // (num_layers * 2 * num_pool_blocks)
        starts = [((layer * 2 + kv) * num_pool_blocks + block) * segment
                  for block in block_ids for layer in layers for kv in (0, 1)]
        return [flat[start : start + segment] for start in starts]

    def pool_view(self) -> memoryview | None:
        """The whole pool's bytes, writable; None where it is not in host memory."""
        if self.device.type != "cpu":
            return None
        return memoryview(self.kv_cache.view(-1).view(torch.uint8).numpy())

    def blocks_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.kv_cache.shape[:2], *self.kv_cache.shape[3:])


_SAME_WIDTH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's elements as integers of their width (numpy has no bfloat16)."""
    return tensor.view(_SAME_WIDTH_INTS[tensor.element_size()]).numpy()


def _pad_block_tables(block_tables: list[list[int]]) -> np.ndarray:
    width = max((len(t) for t in block_tables), default=0)
    out = np.zeros((len(block_tables), max(width, 1)), dtype=np.int32)
    for i, table in enumerate(block_tables):
        out[i, : len(table)] = table
    return out
