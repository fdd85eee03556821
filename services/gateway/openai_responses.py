"""The OpenAI API's response bodies and stream chunks: plain dicts shaped like OpenAI's (the official
`openai` client's types parse them). Requests and errors: openai_schema.py."""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass
from typing import Any

import orjson

from services.gateway.openai_schema import FinishReason

# OpenAI's stand-in for -inf: JSON has no infinities.
LOGPROB_FLOOR = -9999.0
SSE_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True, frozen=True)
class ResponseMeta:
    """What every body and chunk of one response repeats."""

    id: str
    model: str
    created: int


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_bytes: bytes
    logprob: float


@dataclass(slots=True, frozen=True)
class PositionLogprobs:
    """The sampled token at one output position and the most likely alternatives, best first."""

    sampled: TokenLogprob
    top: list[TokenLogprob]


@dataclass(slots=True, frozen=True)
class Choice:
    """One finished choice of a non-streamed response."""

    index: int
    text: str
    finish_reason: FinishReason
    logprobs: list[PositionLogprobs] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # when set, the text was the calls'


def token_text(token_bytes: bytes) -> str:
    """A token as logprobs name it: its text, or OpenAI's `bytes:\\x..` when it splits a character."""
    try:
        return token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in token_bytes)


def _finite(logprob: float) -> float:
    # Also maps NaN to the floor: NaN > x is false.
    return max(LOGPROB_FLOOR, logprob)


def _chat_token(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": token_text(entry.token_bytes), "logprob": _finite(entry.logprob), "bytes": list(entry.token_bytes)}


def chat_logprobs(positions: list[PositionLogprobs]) -> dict[str, Any]:
    return {
        "content": [
            _chat_token(pos.sampled) | {"top_logprobs": [_chat_token(entry) for entry in pos.top]} for pos in positions
        ]
    }


def completion_logprobs(positions: list[PositionLogprobs], text_offset: int = 0) -> dict[str, Any]:
    """Legacy completions format; `text_offset` is where these tokens' text starts in the choice's text."""
    return {
        "tokens": [token_text(pos.sampled.token_bytes) for pos in positions],
        "token_logprobs": [_finite(pos.sampled.logprob) for pos in positions],
        "top_logprobs": [{token_text(e.token_bytes): _finite(e.logprob) for e in pos.top} for pos in positions],
        "text_offset": _text_offsets([pos.sampled.token_bytes for pos in positions], text_offset),
    }


def _text_offsets(pieces: list[bytes], start: int) -> list[int]:
    """Character offset at which each token's bytes begin (a split character counts where it ends)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, offset = [], start
    for piece in pieces:
        offsets.append(offset)
        offset += len(decoder.decode(piece))
    return offsets


def _envelope(meta: ResponseMeta, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model, "choices": choices}


def completion_body(meta: ResponseMeta, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    built = [
        {
            "index": c.index,
            "text": c.text,
            "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs),
            "finish_reason": c.finish_reason,
        }
        for c in choices
    ]
    return _envelope(meta, "text_completion", built) | {"usage": usage.to_dict()}


def chat_completion_body(meta: ResponseMeta, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    built = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text} if c.tool_calls is None
            else {"role": "assistant", "content": None, "tool_calls": c.tool_calls},
            "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs),
            "finish_reason": c.finish_reason,
        }
        for c in choices
    ]
    return _envelope(meta, "chat.completion", built) | {"usage": usage.to_dict()}


def completion_chunk(
    meta: ResponseMeta,
    index: int,
    text: str,
    finish_reason: FinishReason | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(meta, "text_completion", [choice])


def chat_first_chunk(
    meta: ResponseMeta,
    index: int,
    content: str,
    finish_reason: FinishReason | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A chat choice's first chunk: it names the role and carries the choice's first text. It goes out with
    the first token, never before: benchmark clients take the first chunk as the time to first token."""
    return chat_chunk(meta, index, {"role": "assistant", "content": content}, finish_reason, logprobs)


def chat_delta_chunk(
    meta: ResponseMeta,
    index: int,
    content: str | None,
    finish_reason: FinishReason | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """New content for a chat choice; the last one carries `finish_reason` (content may be None)."""
    delta = {} if content is None else {"content": content}
    return chat_chunk(meta, index, delta, finish_reason, logprobs)


def chat_chunk(
    meta: ResponseMeta,
    index: int,
    delta: dict[str, Any],
    finish_reason: FinishReason | None,
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(meta, "chat.completion.chunk", [choice])


def completion_usage_chunk(meta: ResponseMeta, usage: Usage) -> dict[str, Any]:
    """The chunk after all choices finished, when stream_options.include_usage is set."""
    return _envelope(meta, "text_completion", []) | {"usage": usage.to_dict()}


def chat_usage_chunk(meta: ResponseMeta, usage: Usage) -> dict[str, Any]:
    """The chunk after all choices finished, when stream_options.include_usage is set."""
    return _envelope(meta, "chat.completion.chunk", []) | {"usage": usage.to_dict()}


def models_body(model_ids: list[str], created: int, owned_by: str) -> dict[str, Any]:
    """Body of GET /v1/models."""
    models = [{"id": model_id, "object": "model", "created": created, "owned_by": owned_by} for model_id in model_ids]
    return {"object": "list", "data": models}


def sse_event(obj: dict[str, Any], has_floats: bool = False) -> bytes:
    """One server-sent event, its JSON compact and in UTF-8. orjson, not json: a streamed token costs
    one chunk, and json.dumps was 7% of a busy gateway's time (py-spy, a 256-request burst). orjson
    writes NaN and infinities as null; JSON has neither, so where `has_floats` (a chunk with logprobs,
    the only floats a chunk carries) they raise, as json.dumps did."""
    if has_floats and not _all_finite(obj):
        raise ValueError(f"Out of range float values are not JSON compliant: {obj!r}")
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _all_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_all_finite(v) for v in value)
    return True
