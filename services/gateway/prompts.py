"""API inputs to prompt token ids. Encoding runs in a thread: a prompt of megabytes must not
stall the event loop that streams everyone else's tokens."""

from __future__ import annotations

import asyncio
from typing import Any

from services.gateway.openai_schema import ApiError, check_token_ids
from shared.text.tokenizer import ChatTemplateError, Tokenizer


async def encode_prompts(tokenizer: Tokenizer, prompts: list[str | list[int]]) -> list[list[int]]:
    """Text prompts encoded as the offline API encodes them, in a thread (a long text takes
    milliseconds); token-id prompts only checked against the vocabulary, here: the check takes
    microseconds, less than the hop to a thread and back."""
    if any(isinstance(prompt, str) for prompt in prompts):
        return await asyncio.to_thread(_encode_all, tokenizer, prompts)
    return _encode_all(tokenizer, prompts)


def _encode_all(tokenizer: Tokenizer, prompts: list[str | list[int]]) -> list[list[int]]:
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            token_ids = tokenizer.encode(prompt)
            if not token_ids:
                raise ApiError(400, f"prompt {prompt!r} encodes to no tokens", param="prompt")
        else:
            check_token_ids(prompt, tokenizer.vocab_size, "prompt")
            token_ids = list(prompt)
        encoded.append(token_ids)
    return encoded


async def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)


async def encode_chat(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The messages rendered by the model's chat template (with `tools` where it knows them), as token ids."""
    try:
        return await asyncio.to_thread(tokenizer.apply_chat_template, messages, add_generation_prompt, tools)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param="messages") from e
