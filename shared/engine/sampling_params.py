"""Per-request sampling parameters, shared by the offline API, the gateway and the workers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shared.engine.constraint import StructuredSpec

MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names it for the API's error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    """What a caller may ask of the sampler.

    `temperature == 0` means greedy. `top_k is None` and `top_p == 1` disable those filters.
    A `seed` makes the request's tokens independent of whatever else shares its batch.
    `stop` strings are matched on detokenised text by whoever detokenises (gateway or
    offline API); the engine itself stops on token ids only. `structured` constrains the output
    to a JSON schema, a regex, a choice or a grammar (shared/engine/constraint.py).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredSpec | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}"),
            (0.0 <= self.temperature <= 2.0, "temperature",
             f"temperature must be between 0 and 2, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k is None or self.top_k >= 1, "top_k", f"top_k must be at least 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be between 0 and 1, got {self.min_p}"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be between -2 and 2, got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be between -2 and 2, got {self.frequency_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}"),
            (len(self.stop) <= MAX_STOP_SEQUENCES, "stop",
             f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(self.stop)}"),
            (all(s for s in self.stop), "stop", "stop sequences must be non-empty strings"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be non-negative"),
            # the grammar may need an end-of-sequence token where min_tokens bans it
            (self.structured is None or self.min_tokens == 0, "min_tokens",
             "min_tokens cannot be combined with a structured output constraint"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise SamplingParamsError(param, message)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        structured = data.get("structured")
        if isinstance(structured, dict):
            data = data | {"structured": StructuredSpec.from_dict(structured)}
        return cls(**data)
