"""The engine: requests in, tokens out, one continuous-batching step at a time.

`step()` reads as one sentence: plan = scheduler.schedule() -> result = runner.execute(plan)
-> scheduler.update(plan, result). It also carries the prefill->decode seam (its methods in
shared/engine/kv_handoff.py): a prefill engine exports a request's KV blocks and first token, a decode
engine imports them and continues.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kernels.kv_quant import kv_format
from shared.engine.kv_cache_manager import KVCacheManager, KVCacheStats
from shared.engine.kv_handoff import KVHandoff
from shared.engine.policy import StepPolicy
from shared.engine.policy.step_cost import attention_pairs
from shared.engine.request import ReqId, Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from shared.model.llama import LlamaModel
from shared.engine.step_phases import OUTPUTS, SCHEDULE, UPDATE, StepPhases
from shared.model.loader import LoadedModel, load_model
from shared.model.runner import ModelRunner, kv_block_bytes
from shared.settings import EngineSettings

if TYPE_CHECKING:  # xgrammar and transformers load with the first constrained request, not at start
    from shared.engine.structured import GrammarMatcher, Grammars

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """The request can never run on this engine; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class RequestOutput:
    """What one step added to one request."""

    req_id: ReqId
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    new_top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    is_prefilled: bool = False

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv: KVCacheStats
    num_importing: int = 0
    num_prefilled: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16
    # measured (bench.engine, on each kind of machine): with native bf16 matrix units (AMX, AVX512-BF16) bfloat16
    # runs the engine about twice as fast as float32; without them bf16 is emulated and slower
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; set kv_cache.memory_bytes")


class Engine(KVHandoff):
    """See the module's docstring; the KV handoff's two sides are `KVHandoff`'s (shared/engine/kv_handoff.py)."""

    def __init__(self, settings: EngineSettings, loaded: LoadedModel | None = None) -> None:
        self.settings = settings
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        loaded = loaded or load_model(settings.model.path, settings.model.disk_cache)
        self.config = loaded.config
        device = resolve_device(settings.model.device)
        dtype = resolve_dtype(settings.model.dtype, device)
        self.model_path = loaded.path
        model = LlamaModel(self.config, loaded.weights, dtype, device, loaded.quantized)
        kv = settings.kv_cache
        kv_fmt = kv_format(kv.dtype, dtype)
        block_bytes = kv_block_bytes(self.config, kv.block_size, kv_fmt)
        budget = kv.memory_bytes or int(available_memory_bytes(device) * kv.memory_fraction)
        num_blocks = budget // block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"KV budget of {budget} bytes holds {num_blocks} blocks of {block_bytes} bytes; at least 2 are needed"
            )
        self.block_size = kv.block_size
        model_len = min(settings.model.max_model_len or self.config.max_position_embeddings,
                        self.config.max_position_embeddings)
        # a request longer than the whole pool, once preempted, could never be scheduled again: the
        # pool bounds the context as the model does
        self.max_model_len = min(model_len, num_blocks * kv.block_size)
        self.context_bound = "this model's context" if self.max_model_len == model_len else "this worker's KV cache"
        if self.max_model_len < model_len:
            logger.warning(
                "the KV cache holds %d tokens (%d blocks), fewer than the model's context of %d: requests end at "
                "%d tokens; raise LLMD_KV_CACHE__MEMORY_BYTES or LLMD_KV_CACHE__MEMORY_FRACTION for longer ones",
                self.max_model_len, num_blocks, model_len, self.max_model_len,
            )
        self.kv_cache = KVCacheManager(num_blocks, kv.block_size, kv.enable_prefix_caching)
        sched = settings.scheduler
        self.policy = StepPolicy(settings.targets, device.type, sched.max_num_batched_tokens,
                                 sched.enable_chunked_prefill)
        self.scheduler = Scheduler(
            SchedulerConfig(sched.max_num_batched_tokens, sched.max_num_seqs, sched.enable_chunked_prefill,
                            sched.kv_reservation, sched.long_prefill_token_threshold, self.policy.order),
            self.kv_cache,
        )
        self.phases = StepPhases()
        self.runner = ModelRunner(model, num_blocks, kv.block_size, self.max_model_len, sched.max_num_seqs, kv_fmt,
                                  self.phases)
        self._requests: dict[ReqId, Request] = {}
        self._importing: dict[ReqId, Request] = {}
        self._rng = random.Random()
        self._grammars: Grammars | None = None  # loaded with the first constrained request
        self.num_steps = 0
        # the plan whose forward pass runs now: a hook between layers reads what each request computes
        self.step_plan: ScheduledBatch | None = None
        self.last_step_tokens = 0  # the tokens the last step that computed something computed

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.model.dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop_after_prefill: bool = False,
        output_token_ids: list[int] | None = None,
        seed: int | None = None,
    ) -> Request:
        """Queue a request. `output_token_ids` continues a run that was cut short (its worker died):
        those tokens count as output, so the next sampled token has output position
        len(output_token_ids) and a seeded re-run samples exactly what the first run would have.
        `seed` overrides `params.seed` (a gateway draws one for every request)."""
        output_token_ids = list(output_token_ids or [])
        self._validate(req_id, list(prompt_token_ids) + output_token_ids)
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(
            req_id=ReqId(req_id),
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            seed=seed,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            stop_after_prefill=stop_after_prefill,
            output_token_ids=output_token_ids,
            grammar=self._grammar_for(params, output_token_ids),
        )
        self._requests[req.req_id] = req
        self.scheduler.add(req)
        return req

    def _validate(self, req_id: str, prompt_token_ids: list[int]) -> None:
        if req_id in self._requests or req_id in self._importing:
            raise InvalidRequestError("req_id", f"request id {req_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "the prompt is empty; at least one token is required")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {len(prompt_token_ids)} tokens; {self.context_bound} holds {self.max_model_len} "
                f"tokens, so prompts may have at most {self.max_model_len - 1}",
            )
        vocab = self.config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")

    def _grammar_for(self, params: SamplingParams, output_token_ids: list[int]) -> GrammarMatcher | None:
        """The request's grammar state after the output it already has; raises GrammarError."""
        if params.structured is None:
            return None
        if self._grammars is None:
            from shared.engine.structured import Grammars
            from shared.text.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_path(str(self.model_path), self.settings.model.disk_cache)
            self._grammars = Grammars(tokenizer, self.config.vocab_size, self.eos_token_ids)
        return self._grammars.matcher(params.structured, output_token_ids)

    def abort_request(self, req_id: str) -> bool:
        """Cancel a request anywhere in the engine and free its blocks now; False if unknown."""
        rid = ReqId(req_id)
        req = self._requests.pop(rid, None) or self._importing.pop(rid, None)
        if req is None:
            return False
        if self.scheduler.abort(rid) is None:
            self.kv_cache.free(req)
        req.status = RequestStatus.FINISHED_ABORTED
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def unfinished_sure_tokens(self, streams_only: bool = False) -> dict[str, int]:
        """The requests the scheduler holds, running or waiting, each with `Request.num_sure_output_tokens`;
        `streams_only`: only those with a first token (sampled here or come with a handoff), the
        streams a long step delays."""
        return {req.req_id: req.num_sure_output_tokens for reqs in (self.scheduler.running, self.scheduler.waiting)
                for req in reqs if req.num_output_tokens or not streams_only}  # fmt: skip

    def step(self) -> list[RequestOutput]:
        """One step, its prompt tokens capped beside running decodes as `policy` decides."""
        started = time.perf_counter()
        phases = self.phases
        phases.start()
        plan = self.scheduler.schedule(self._prompt_cap())
        phases.lap(SCHEDULE)
        if plan.is_empty:
            return []
        self.step_plan = plan
        try:
            result = self.runner.execute(plan)
        finally:
            self.step_plan = None
        sampled = self.scheduler.update(plan, result)
        self.num_steps += 1
        self.last_step_tokens = plan.num_tokens
        # after the update: each request's context before this step is its count less what it computed
        pairs = sum(attention_pairs(n, req.num_computed_tokens - n)
                    for req, n in zip(plan.reqs, plan.num_new_tokens) if n > 1)
        self.policy.observe_step(plan.num_tokens, pairs, time.perf_counter() - started)
        phases.lap(UPDATE)
        outputs = [self._output(req) for req in sampled]
        phases.lap(OUTPUTS)
        return outputs

    def prompt_held_back(self) -> Request | None:
        """The prompt the next step serves first where the policy's cap, beside running decodes, lets it
        take fewer tokens than it has left (None where nothing holds a prompt back)."""
        return self._capped_prompt()[0]

    def _prompt_cap(self) -> int | None:
        """The step's cap on prompt tokens; lifted where the held-back prompt takes a whole step."""
        prompt, cap = self._capped_prompt()
        if prompt is not None and self.policy.takes_whole_step(
                prompt, time.monotonic() - prompt.arrived_s, self.unfinished_sure_tokens(streams_only=True)):
            return None
        return cap

    def _capped_prompt(self) -> tuple[Request | None, int | None]:
        """The prompt tokens this step may take (None: no cap), and the prompt the step serves first
        where the cap holds it back."""
        if self.policy.budget is None:
            return None, None
        num_decoding = self.scheduler.num_decoding  # first: it is cheap, and finding the prompt may sort them all
        prompt = self.scheduler.next_prompt() if num_decoding else None
        if prompt is None:
            return None, None
        # a waiting prompt's cached prefix is not looked up here: its context counts as computed so far
        cap = self.policy.prompt_cap(num_decoding, prompt.num_computed_tokens)
        return (prompt if cap is not None and prompt.num_tokens - prompt.num_computed_tokens > cap else None), cap

    def _output(self, req: Request) -> RequestOutput:
        wants_logprobs = req.params.logprobs is not None
        if req.is_finished:
            del self._requests[req.req_id]
        return RequestOutput(
            req_id=req.req_id,
            new_token_ids=req.output_token_ids[-1:],
            new_logprobs=req.output_logprobs[-1:] if wants_logprobs else None,
            new_top_logprobs=req.output_top_logprobs[-1:] if wants_logprobs else None,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            is_prefilled=req.status is RequestStatus.PREFILLED,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            kv=self.kv_cache.stats(),
            num_importing=len(self._importing),
            num_prefilled=sum(1 for r in self._requests.values() if r.status is RequestStatus.PREFILLED),
        )

    def check_invariants(self) -> None:
        self.kv_cache.check_invariants()
