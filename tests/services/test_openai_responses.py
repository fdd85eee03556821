"""The OpenAI API's response bodies, stream chunks and SSE framing (services/gateway/openai_responses.py),
checked against the openai client's own types and decoder."""

from __future__ import annotations

import json
import math

import pytest
from openai._streaming import SSEDecoder
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.gateway.openai_responses import (
    SSE_DONE,
    Choice,
    PositionLogprobs,
    ResponseMeta,
    TokenLogprob,
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
    models_body,
    sse_event,
    token_text,
)

META = ResponseMeta(id="cmpl-abc", model="smollm2", created=1700000000)
USAGE = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4)
SMILE_FIRST, SMILE_LAST = b" \xf0\x9f\x98", b"\x80"
POSITIONS = [
    PositionLogprobs(TokenLogprob(b"Hi", -0.1), [TokenLogprob(b"Hi", -0.1), TokenLogprob(b"Hello", -2.5)]),
    PositionLogprobs(TokenLogprob(SMILE_FIRST, -0.5), [TokenLogprob(SMILE_FIRST, -0.5)]),
    PositionLogprobs(TokenLogprob(SMILE_LAST, -math.inf), [TokenLogprob(SMILE_LAST, math.nan)]),
    PositionLogprobs(TokenLogprob(b"!", -1.0), []),
]


def test_token_text_names_split_characters_by_bytes() -> None:
    assert token_text(b" world") == " world"
    assert token_text(SMILE_FIRST) == "bytes:\\x20\\xf0\\x9f\\x98"


def test_completion_logprobs_format() -> None:
    assert completion_logprobs(POSITIONS, text_offset=10) == {
        "tokens": ["Hi", "bytes:\\x20\\xf0\\x9f\\x98", "bytes:\\x80", "!"],
        "token_logprobs": [-0.1, -0.5, -9999.0, -1.0],
        "top_logprobs": [
            {"Hi": -0.1, "Hello": -2.5},
            {"bytes:\\x20\\xf0\\x9f\\x98": -0.5},
            {"bytes:\\x80": -9999.0},
            {},
        ],
        # "Hi" is 2 chars; " 😀" starts at 12 and is complete only after its last byte.
        "text_offset": [10, 12, 13, 14],
    }


def test_chat_logprobs_format() -> None:
    content = chat_logprobs(POSITIONS[:2])["content"]
    assert content == [
        {
            "token": "Hi",
            "logprob": -0.1,
            "bytes": [72, 105],
            "top_logprobs": [
                {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]},
                {"token": "Hello", "logprob": -2.5, "bytes": [72, 101, 108, 108, 111]},
            ],
        },
        {
            "token": "bytes:\\x20\\xf0\\x9f\\x98",
            "logprob": -0.5,
            "bytes": [32, 240, 159, 152],
            "top_logprobs": [{"token": "bytes:\\x20\\xf0\\x9f\\x98", "logprob": -0.5, "bytes": [32, 240, 159, 152]}],
        },
    ]


def test_completion_body_parses_as_openai_completion() -> None:
    choices = [Choice(0, "Hi 😀!", "length", POSITIONS), Choice(1, "Yo", "stop")]
    body = completion_body(META, choices, USAGE)
    parsed = Completion.model_validate(body)
    assert parsed.object == "text_completion"
    assert [c.text for c in parsed.choices] == ["Hi 😀!", "Yo"]
    assert parsed.choices[0].logprobs is not None and parsed.choices[0].logprobs.text_offset == [0, 2, 3, 4]
    assert parsed.choices[1].logprobs is None
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4


def test_chat_completion_body_parses_as_openai_chat_completion() -> None:
    body = chat_completion_body(META, [Choice(0, "Hello!", "stop", POSITIONS)], USAGE)
    parsed = ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == "Hello!"
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.choices[0].logprobs is not None and parsed.choices[0].logprobs.content is not None
    assert [t.logprob for t in parsed.choices[0].logprobs.content] == [-0.1, -0.5, -9999.0, -1.0]
    assert parsed.usage is not None and parsed.usage.total_tokens == 10


def test_chat_stream_chunks_parse_as_openai_chunks() -> None:
    chunks = [
        chat_first_chunk(META, 0, "Hel", logprobs=chat_logprobs(POSITIONS[:1])),
        chat_delta_chunk(META, 0, "lo"),
        chat_delta_chunk(META, 0, None, finish_reason="length"),
        chat_usage_chunk(META, USAGE),
    ]
    parsed = [ChatCompletionChunk.model_validate(chunk) for chunk in chunks]
    assert all(p.object == "chat.completion.chunk" and p.id == "cmpl-abc" for p in parsed)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert [p.choices[0].delta.content for p in parsed[:3]] == ["Hel", "lo", None]
    assert [p.choices[0].finish_reason for p in parsed[:3]] == [None, None, "length"]
    assert chunks[2]["choices"][0]["delta"] == {}
    assert chunks[3]["choices"] == [] and parsed[3].usage is not None and parsed[3].usage.completion_tokens == 3


def test_completion_stream_chunks() -> None:
    middle = completion_chunk(META, 1, "Hel", logprobs=completion_logprobs(POSITIONS[:1], text_offset=3))
    assert middle == {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 1700000000,
        "model": "smollm2",
        "choices": [
            {
                "index": 1,
                "text": "Hel",
                "logprobs": {"tokens": ["Hi"], "token_logprobs": [-0.1], "top_logprobs": [{"Hi": -0.1, "Hello": -2.5}],
                             "text_offset": [3]},
                "finish_reason": None,
            }
        ],
    }  # fmt: skip
    # OpenAI streams finish_reason null mid-stream, which its own non-optional type does not admit.
    Completion.model_validate(middle | {"choices": [middle["choices"][0] | {"finish_reason": "stop"}]})
    final = Completion.model_validate(completion_chunk(META, 1, "", finish_reason="stop"))
    assert final.choices[0].finish_reason == "stop"
    usage = Completion.model_validate(completion_usage_chunk(META, USAGE))
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 10


def test_models_body_parses_as_openai_models() -> None:
    body = models_body(["smollm2"], created=1700000000, owned_by="gateway")
    assert body["object"] == "list"
    assert Model.model_validate(body["data"][0]).id == "smollm2"


def test_sse_framing_round_trips_through_openai_decoder() -> None:
    chunk = chat_delta_chunk(META, 0, "héllo 😀\n")
    stream = sse_event(chunk) + sse_event(chat_usage_chunk(META, USAGE)) + SSE_DONE
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    events = list(SSEDecoder().iter_bytes(iter([stream[:7], stream[7:]])))
    assert [json.loads(e.data) for e in events[:2]] == [chunk, chat_usage_chunk(META, USAGE)]
    assert events[0].data == json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
    assert events[2].data == "[DONE]"


def test_sse_refuses_non_json_numbers() -> None:
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        sse_event({"logprob": math.nan}, has_floats=True)
