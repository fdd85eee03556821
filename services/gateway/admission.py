"""Admission control: a bound on the work in flight, answered at once with 429 when reached.

Work is counted in requests on the workers (one per prompt and sample: an API request with
2 prompts and n=3 is 6) and in their prompt tokens, the two things that queue up in front of
the prefill pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from services.gateway.openai_schema import ApiError

RETRY_AFTER_S = 1


@dataclass(slots=True)
class Admission:
    max_requests: int
    max_prompt_tokens: int
    num_requests: int = 0
    num_prompt_tokens: int = 0

    @contextmanager
    def hold(self, num_requests: int, num_prompt_tokens: int) -> Iterator[None]:
        """Count the work in flight for the duration of the block; raises ApiError (429 or 400)."""
        self.admit(num_requests, num_prompt_tokens)
        try:
            yield
        finally:
            self.num_requests -= num_requests
            self.num_prompt_tokens -= num_prompt_tokens

    def admit(self, num_requests: int, num_prompt_tokens: int) -> None:
        for num, in_flight, limit, what, setting in (
            (num_requests, self.num_requests, self.max_requests, "requests", "max_queued_requests"),
            (num_prompt_tokens, self.num_prompt_tokens, self.max_prompt_tokens, "prompt tokens",
             "max_queued_prompt_tokens"),
        ):  # fmt: skip
            if num > limit:
                raise ApiError(
                    400, f"This request needs {num} {what} in flight at once; the gateway admits at most {limit} "
                    f"(gateway.{setting}). Send fewer prompts or a smaller n.", code="request_too_large",
                )
            if in_flight + num > limit:
                raise ApiError(
                    429, f"The gateway is at capacity: {in_flight} {what} in flight, this request adds {num}, the "
                    f"limit is {limit} (gateway.{setting}). Retry after {RETRY_AFTER_S} s.",
                    type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)},
                )
        self.num_requests += num_requests
        self.num_prompt_tokens += num_prompt_tokens
