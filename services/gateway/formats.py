"""How each endpoint shapes the same choices: the completions and the chat completions formats."""

from __future__ import annotations

from typing import Any, Protocol

from services.gateway.generation import ChoiceDelta
from services.gateway.openai_responses import (
    Choice,
    ResponseMeta,
    Usage,
    chat_completion_body,
    chat_delta_chunk,
    chat_first_chunk,
    chat_logprobs,
    chat_usage_chunk,
    completion_body,
    completion_chunk,
    completion_logprobs,
    completion_usage_chunk,
)


class ResponseFormat(Protocol):
    id_prefix: str

    def body(self, meta: ResponseMeta, choices: list[Choice], usage: Usage) -> dict[str, Any]: ...

    def chunk(self, meta: ResponseMeta, delta: ChoiceDelta) -> dict[str, Any]: ...

    def usage_chunk(self, meta: ResponseMeta, usage: Usage) -> dict[str, Any]: ...


class CompletionFormat:
    id_prefix = "cmpl"

    def body(self, meta: ResponseMeta, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        return completion_body(meta, choices, usage)

    def chunk(self, meta: ResponseMeta, delta: ChoiceDelta) -> dict[str, Any]:
        logprobs = None if delta.logprobs is None else completion_logprobs(delta.logprobs, delta.text_offset)
        return completion_chunk(meta, delta.index, delta.text, delta.finish_reason, logprobs)

    def usage_chunk(self, meta: ResponseMeta, usage: Usage) -> dict[str, Any]:
        return completion_usage_chunk(meta, usage)


class ChatFormat:
    id_prefix = "chatcmpl"

    def body(self, meta: ResponseMeta, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        return chat_completion_body(meta, choices, usage)

    def chunk(self, meta: ResponseMeta, delta: ChoiceDelta) -> dict[str, Any]:
        logprobs = None if delta.logprobs is None else chat_logprobs(delta.logprobs)
        if delta.is_first:
            return chat_first_chunk(meta, delta.index, delta.text, delta.finish_reason, logprobs)
        return chat_delta_chunk(meta, delta.index, delta.text or None, delta.finish_reason, logprobs)

    def usage_chunk(self, meta: ResponseMeta, usage: Usage) -> dict[str, Any]:
        return chat_usage_chunk(meta, usage)


COMPLETION = CompletionFormat()
CHAT = ChatFormat()
