"""The prefill->decode seam of an engine: a prefill engine exports a prefilled request (its
`Handoff` and KV blocks), a decode engine reserves blocks for it, receives the bytes and lets it
join its batch. `Engine` takes these methods from `KVHandoff`; they use its pool, scheduler and
request tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.kv_quant import KVFormat
from shared.engine.request import ReqId, Request, RequestStatus
from shared.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shared.engine.kv_cache_manager import KVCacheManager
    from shared.engine.scheduler import Scheduler
    from shared.engine.structured import GrammarMatcher
    from shared.model.runner import ModelRunner


@dataclass(slots=True)
class Handoff:
    """A prefilled request as a decode engine needs it: everything but the KV bytes."""

    req_id: ReqId
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float]
    output_top_logprobs: list[list[tuple[int, float]]]
    params: SamplingParams
    seed: int
    num_cached_tokens: int
    num_blocks: int
    # offered before the prefill sampled: every token's KV comes, and the first sampled token
    # follows with `add_first_token` (a prefill worker that streams KV while it prefills)
    first_token_pending: bool = False



class KVHandoff:
    """The handoff's methods of `Engine`, apart from its steps."""

    # what they use of the engine
    kv_cache: KVCacheManager
    runner: ModelRunner
    scheduler: Scheduler
    block_size: int
    max_model_len: int
    _requests: dict[ReqId, Request]
    _importing: dict[ReqId, Request]

    if TYPE_CHECKING:
        @property
        def eos_token_ids(self) -> tuple[int, ...]: ...

        def _validate(self, req_id: str, prompt_token_ids: list[int]) -> None: ...

        def _grammar_for(self, params: SamplingParams, output_token_ids: list[int]) -> GrammarMatcher | None: ...

    # -- prefill side of the handoff --------------------------------------------------------

    def export_handoff(self, req_id: str) -> Handoff:
        req = self._prefilled(req_id)
        return Handoff(
            req_id=req.req_id,
            prompt_token_ids=list(req.prompt_token_ids),
            output_token_ids=list(req.output_token_ids),
            output_logprobs=list(req.output_logprobs),
            output_top_logprobs=list(req.output_top_logprobs),
            params=req.params,
            seed=req.seed,
            num_cached_tokens=req.num_cached_tokens,
            num_blocks=len(self.kv_cache.blocks(req.req_id)),
        )

    def read_kv_blocks(self, req_id: str, block_indices: list[int]) -> torch.Tensor:
        """KV of the request's blocks at the given table positions: [n, layers, 2, block_size, kv_heads, head_dim]."""
        table = self.kv_block_ids(req_id)
        return self.read_blocks([table[i] for i in block_indices])

    def kv_block_ids(self, req_id: str) -> list[int]:
        """The pool blocks of a prefilled request, in table order; fixed until `release` or an abort."""
        return list(self.kv_cache.block_ids(self._prefilled(req_id).req_id))

    def read_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of pool blocks, as `read_kv_blocks` returns them, into `out` where given
        (shaped `kv_blocks_shape`, in `kv_dtype`).

        Unlike every other method, this one may run on another thread while a step runs, for the
        blocks of a prefilled request: no step writes them (a prefilled request is never
        scheduled, and its shared full blocks are immutable) and none is freed before the
        request's `release` or abort. So a handoff's copy need not wait for a long prefill step.
        """
        return self.runner.read_blocks(block_ids, out)

    def kv_block_views(self, block_ids: list[int]) -> list[memoryview] | None:
        """The bytes `read_blocks` gives, as writable views of the pool itself (None where the
        pool is not in host memory): a transport sends from a prefilled request's blocks and
        receives into an imported request's reserved blocks without a copy, under the rules of
        `read_blocks` and `write_blocks`."""
        return self.runner.block_views(block_ids)

    def kv_layer_views(self, block_ids: list[int], layer: int) -> list[memoryview] | None:
        """One layer's share of `kv_block_views`: each block's K then V bytes of `layer`, so a
        transport can send a layer as soon as a step has computed it (while later layers run)."""
        return self.runner.layer_views(block_ids, layer)

    def kv_pool_view(self) -> memoryview | None:
        """The whole pool's bytes as one view (None where the pool is not in host memory), for a
        transport that registers the pool's memory once (NIXL); `kv_block_views` are inside it."""
        return self.runner.pool_view()

    def kv_blocks_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape `read_blocks` gives that many blocks."""
        return self.runner.blocks_shape(num_blocks)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The element dtype of `read_blocks`' tensors (uint8 for the 8-bit formats, whose bytes hold their scales)."""
        return self.runner.kv_cache.dtype

    @property
    def kv_format(self) -> KVFormat:
        """How the pool stores KV (`kv_cache.dtype` resolved); both sides of a handoff must agree on it."""
        return self.runner.kv_format

    def release(self, req_id: str) -> None:
        """Drop a prefilled request after handoff; its full blocks stay in the prefix cache."""
        req = self._prefilled(req_id)
        self.kv_cache.free(req)
        del self._requests[req.req_id]

    def _prefilled(self, req_id: str) -> Request:
        req = self._requests.get(ReqId(req_id))
        if req is None or req.status is not RequestStatus.PREFILLED:
            raise KeyError(f"request {req_id!r} is not a prefilled request held by this engine")
        return req

    # -- decode side of the handoff ---------------------------------------------------------

    def reserve_import(self, handoff: Handoff) -> list[int] | None:
        """Take blocks for an incoming request before its bytes move.

        Returns the block-table positions whose KV must be sent (those not already cached
        here), or None when the pool cannot hold the request now.
        """
        self._validate(handoff.req_id, handoff.prompt_token_ids)
        req = Request(
            req_id=handoff.req_id,
            prompt_token_ids=list(handoff.prompt_token_ids),
            params=handoff.params,
            seed=handoff.seed,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            output_token_ids=list(handoff.output_token_ids),
            output_logprobs=list(handoff.output_logprobs),
            output_top_logprobs=list(handoff.output_top_logprobs),
            num_cached_tokens=handoff.num_cached_tokens,
            grammar=self._grammar_for(handoff.params, handoff.output_token_ids),
        )
        # the last sampled token's KV is computed here, on the next step
        num_kv_tokens = req.num_tokens - (0 if handoff.first_token_pending else 1)
        cached = self.kv_cache.find_cached_prefix(req)[: num_kv_tokens // self.block_size]
        num_new = num_kv_tokens - len(cached) * self.block_size
        if not self.kv_cache.allocate_slots(req, num_new, cached):
            return None
        req.num_computed_tokens = num_kv_tokens
        self._importing[req.req_id] = req
        return list(range(len(cached), len(self.kv_cache.blocks(req.req_id))))

    def write_kv_blocks(self, req_id: str, block_indices: list[int], data: torch.Tensor) -> None:
        self.write_blocks(self.import_block_ids(req_id, block_indices), data)

    def import_block_ids(self, req_id: str, block_indices: list[int]) -> list[int]:
        """The pool blocks at those table positions of a request reserved by `reserve_import`."""
        table = self.kv_cache.block_ids(self._importing[ReqId(req_id)].req_id)
        return [table[i] for i in block_indices]

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Fill pool blocks with data shaped as `read_blocks` returns it.

        Like `read_blocks`, this may run on another thread while a step runs, for the blocks
        `import_block_ids` names: a request is not scheduled before `commit_import`, and the
        blocks it receives are its own (cached ones are never sent). The caller must not abort
        the request while the write runs, or the blocks could be handed to another request.
        """
        self.runner.write_blocks(block_ids, data)

    def add_first_token(
        self, req_id: str, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None,
        num_cached_tokens: int,
    ) -> None:
        """The token the prefill sampled, for a request reserved with `first_token_pending`."""
        req = self._importing[ReqId(req_id)]
        req.append_output(token_id, logprob, top)
        req.num_cached_tokens = num_cached_tokens

    def commit_import(self, req_id: str) -> None:
        """The KV bytes are in place: the request joins the batch at the next step."""
        req = self._importing.pop(ReqId(req_id))
        self.kv_cache.cache_full_blocks(req)
        self._requests[req.req_id] = req
        self.scheduler.add(req)

    def import_handoff(self, handoff: Handoff, kv_blocks: torch.Tensor) -> bool:
        """Reserve, write and commit in one call (for a source that holds every block)."""
        needed = self.reserve_import(handoff)
        if needed is None:
            return False
        self.write_kv_blocks(handoff.req_id, needed, kv_blocks[needed])
        self.commit_import(handoff.req_id)
        return True
