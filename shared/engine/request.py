"""A generation request and its single progress counter.

Every phase is "compute the tokens not yet computed": `num_computed_tokens` counts the tokens
whose KV is in the cache; `num_tokens` counts prompt plus generated tokens. Prefill, chunked
prefill, resumption after preemption and decode differ only in how far apart the two are.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

from shared.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shared.engine.structured import GrammarMatcher

ReqId = NewType("ReqId", str)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"  # first token sampled; KV held for export to a decode worker
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(slots=True, eq=False)
class Request:
    req_id: ReqId
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    stop_after_prefill: bool = False
    token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    grammar: GrammarMatcher | None = None  # where params.structured is set: has accepted every output token
    arrived_s: float = field(default_factory=time.monotonic)  # when this engine took it (time.monotonic)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    @property
    def num_sure_output_tokens(self) -> int:
        """The output tokens this request produces unless it is aborted: `min_tokens`, or its whole
        length where only that can end it (`ignore_eos` and no stop ids); none where stop strings (the
        gateway matches them on any token) or a grammar (it ends when complete) may end it sooner; at
        most what the context leaves. The step policy plans late gaps on it (shared/engine/policy/late_gaps.py)."""
        params = self.params
        if params.stop or params.structured is not None:
            return 0
        sure = params.max_tokens if params.ignore_eos and not params.stop_token_ids else params.min_tokens
        return min(sure, self.max_model_len - self.num_prompt_tokens)

    def append_output(self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)

    def stop_status(self) -> RequestStatus | None:
        """Why the request must stop after its last sampled token, if it must."""
        last = self.output_token_ids[-1]
        if self.grammar is not None and self.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED  # even under ignore_eos: nothing may follow
        if self.num_output_tokens > self.params.min_tokens:
            if last in self.params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not self.params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
