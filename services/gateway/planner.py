"""From a validated API request and its tokenised prompts to the requests the workers run:
one per prompt and sample, each with its sampling params, seed and deadline."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from dataclasses import dataclass

from services.gateway.inflight import InflightRequest
from services.gateway.openai_schema import (
    MAX_SEED,
    ChatCompletionRequest,
    CompletionRequest,
    check_context_length,
    to_sampling_params,
)
from shared.engine.constraint import StructuredSpec
from shared.engine.sampling_params import SamplingParams
from shared.protocol import TokenUpdate

ApiRequest = CompletionRequest | ChatCompletionRequest
SEED_SPAN = 2**64  # seeds are used modulo this (the sampler keys on the low 64 bits)


@dataclass(slots=True, frozen=True)
class PromptLimits:
    max_model_len: int
    default_max_tokens: int | None  # None: the rest of the context
    param: str  # the request field the prompt came from, for errors


@dataclass(slots=True, frozen=True)
class PlannedChoice:
    index: int  # the choice's index in the response: prompt_index * n + sample_index
    prompt_index: int
    sample_index: int
    req: InflightRequest


def plan_choices(
    api_req: ApiRequest, prompts: list[list[int]], limits: PromptLimits, deadline: float,
    structured: StructuredSpec | None = None,
) -> list[PlannedChoice]:
    """Every choice of the response, in index order; raises ApiError (400) when one cannot fit the context."""
    replies: asyncio.Queue[TokenUpdate] = asyncio.Queue()
    num_samples = api_req.num_choices
    choices = []
    for prompt_index, prompt_token_ids in enumerate(prompts):
        params = sampling_params_for(api_req, len(prompt_token_ids), limits, structured)
        for sample_index in range(num_samples):
            req = InflightRequest(
                req_id=uuid.uuid4().hex, prompt_token_ids=prompt_token_ids, params=params,
                seed=sample_seed(api_req.seed, sample_index), deadline=deadline, replies=replies,
            )  # fmt: skip
            choices.append(PlannedChoice(prompt_index * num_samples + sample_index, prompt_index, sample_index, req))
    return choices


def sampling_params_for(
    api_req: ApiRequest, num_prompt_tokens: int, limits: PromptLimits, structured: StructuredSpec | None = None
) -> SamplingParams:
    room = limits.max_model_len - num_prompt_tokens
    default = room if limits.default_max_tokens is None else min(limits.default_max_tokens, room)
    params = to_sampling_params(api_req, max(1, default), structured)
    check_context_length(num_prompt_tokens, params.max_tokens, limits.max_model_len, limits.param)
    return params


def sample_seed(seed: int | None, sample_index: int) -> int:
    """Sample i of a seeded request runs with seed + i, so n=1 with seed s gives exactly what the
    offline engine gives with seed s (kept in range by wrapping modulo 2**64, as the sampler
    reads it). Unseeded samples get a seed drawn here: a re-run after a worker died then
    reproduces the tokens already streamed."""
    if seed is None:
        return secrets.randbits(63)
    shifted = seed + sample_index
    return shifted - SEED_SPAN if shifted > MAX_SEED else shifted
