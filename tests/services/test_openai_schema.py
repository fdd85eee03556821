"""The OpenAI API's requests and errors (services/gateway/openai_schema.py): parsing, validation
messages that name the field and value, sampling params, and the checks that need the model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.openai_schema import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_context_length,
    check_token_ids,
    error_body,
    parse_request,
    to_sampling_params,
)
from shared.engine.sampling_params import SamplingParams

USER_HI = [{"role": "user", "content": "hi"}]
BAD_SHAPE = "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"


def completion(**fields: Any) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({"prompt": "hi"} | fields))


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps({"messages": USER_HI} | fields))


def rejected(model: type[CompletionRequest] | type[ChatCompletionRequest], body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        req = parse_request(model, json.dumps(body))
        to_sampling_params(req, default_max_tokens=16)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


# ---- request parsing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_shapes_become_a_list_of_prompts(prompt: Any, expected: list[Any]) -> None:
    assert completion(prompt=prompt).prompt == expected


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", 'prompt must not be empty, got ""'),
        ([], "prompt must not be empty, got []"),
        (["a", ""], 'prompt must not be empty, got ["a", ""]'),
        ([[1], []], "prompt must not be empty, got [[1], []]"),
        ([1, "a"], f'{BAD_SHAPE}, got [1, "a"]'),
        (5, f"{BAD_SHAPE}, got 5"),
        ([True], f"{BAD_SHAPE}, got [true]"),
        ([[1, -2]], "prompt token ids must be non-negative, got -2"),
    ],
)  # fmt: skip
def test_bad_prompt_is_rejected_with_its_value(prompt: Any, message: str) -> None:
    err = rejected(CompletionRequest, {"prompt": prompt})
    assert (err.param, err.message) == ("prompt", message)


def test_defaults_leave_sampling_params_defaults() -> None:
    assert to_sampling_params(completion(), default_max_tokens=32) == SamplingParams(max_tokens=32)
    assert to_sampling_params(chat(), default_max_tokens=32) == SamplingParams(max_tokens=32)


def test_nulls_mean_defaults() -> None:
    req = completion(temperature=None, top_p=None, n=None, stop=None, stream=None, max_tokens=None)
    assert to_sampling_params(req, default_max_tokens=8) == SamplingParams(max_tokens=8)
    assert req.num_choices == 1


def test_every_sampling_field_reaches_sampling_params() -> None:
    req = completion(
        max_tokens=50, min_tokens=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, seed=-3,
        stop=["\n\n", "END"], stop_token_ids=[2, 7], ignore_eos=True, logprobs=5,
    )  # fmt: skip
    assert to_sampling_params(req, default_max_tokens=16) == SamplingParams(
        max_tokens=50, min_tokens=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, seed=-3,
        stop=["\n\n", "END"], stop_token_ids=[2, 7], ignore_eos=True, logprobs=5,
    )  # fmt: skip


def test_integer_temperature_is_accepted() -> None:
    assert to_sampling_params(completion(temperature=0), 16).is_greedy


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_or_minus_one_disables_the_filter(top_k: int) -> None:
    assert to_sampling_params(completion(top_k=top_k), 16).top_k is None


def test_single_stop_string_becomes_a_list() -> None:
    assert completion(stop="END").stop == ["END"]


def test_unknown_fields_are_ignored() -> None:
    assert completion(frobnicate=True, metadata={"a": 1}).prompt == ["hi"]


def test_stream_options() -> None:
    req = completion(stream=True, stream_options={"include_usage": True})
    assert req.include_usage and req.stream
    assert not completion(stream=True).include_usage


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"n": 0}, "n", "Invalid value for 'n': Input should be greater than or equal to 1, got 0"),
        ({"n": 17}, "n", "Invalid value for 'n': Input should be less than or equal to 16, got 17"),
        ({"n": "2"}, "n", "Invalid value for 'n': Input should be a valid integer, got \"2\""),
        ({"temperature": "0.5"}, "temperature",
         "Invalid value for 'temperature': Input should be a valid number, got \"0.5\""),
        ({"temperature": 2.5}, "temperature", "temperature must be between 0 and 2, got 2.5"),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "top_k", "top_k must be at least 1, got -2"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0"),
        ({"min_tokens": 20}, "min_tokens", "min_tokens must be between 0 and max_tokens (16), got 20"),
        ({"logprobs": 21}, "logprobs", "logprobs must be between 0 and 20, got 21"),
        ({"presence_penalty": -3}, "presence_penalty", "presence_penalty must be between -2 and 2, got -3.0"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be in (0, 2], got 0.0"),
        ({"seed": 2**64}, "seed",
         f"Invalid value for 'seed': Input should be less than or equal to {2**64 - 1}, got {2**64}"),
        ({"seed": -(2**63) - 1}, "seed",
         f"Invalid value for 'seed': Input should be greater than or equal to {-(2**63)}, got {-(2**63) - 1}"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16 stop sequences are allowed, got 17"),
        ({"stop": [""]}, "stop", "stop sequences must be non-empty strings"),
        ({"stop": ["a", 5]}, "stop.1", "Invalid value for 'stop.1': Input should be a valid string, got 5"),
        ({"stop": 5}, "stop", "stop must be a string or a list of strings, got 5"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0",
         "Invalid value for 'stop_token_ids.0': Input should be greater than or equal to 0, got -1"),
        ({"stream": "yes"}, "stream", "Invalid value for 'stream': Input should be a valid boolean, got \"yes\""),
        ({"stream_options": {"include_usage": True}}, "stream_options",
         "stream_options is only allowed when stream is true"),
        ({"best_of": 3}, "best_of", "best_of is not supported (got 3); use n for several completions"),
        ({"echo": True}, "echo", "echo is not supported"),
        ({"suffix": "tail"}, "suffix", "suffix is not supported"),
        ({"logit_bias": {"50256": -100}}, "logit_bias", "logit_bias is not supported"),
    ],
)  # fmt: skip
def test_completion_validation_errors_name_field_and_value(fields: dict[str, Any], param: str, message: str) -> None:
    err = rejected(CompletionRequest, {"prompt": "hi"} | fields)
    assert (err.param, err.message) == (param, message)


def test_accepted_no_op_values_of_unsupported_fields() -> None:
    req = completion(best_of=1, echo=False, suffix=None, logit_bias={})
    assert to_sampling_params(req, 16) == SamplingParams(max_tokens=16)


def test_long_bad_values_are_shortened_in_messages() -> None:
    err = rejected(CompletionRequest, {"prompt": "hi", "n": "x" * 500})
    assert err.message == "Invalid value for 'n': Input should be a valid integer, got \"" + "x" * 76 + "..."


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ("{bad", None, "Request body is not valid JSON: key must be a string at line 1 column 2"),
        ("[1, 2]", None, "Request body must be a JSON object"),
        ("{}", "prompt", "Missing required parameter: 'prompt'"),
    ],
)
def test_body_level_errors(body: str, param: str | None, message: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_request(CompletionRequest, body)
    assert (info.value.status, info.value.param, info.value.message) == (400, param, message)


def test_error_body_is_openai_envelope() -> None:
    err = ApiError(429, "queue is full", type="rate_limit_error", code="queue_full")
    assert error_body(err) == {
        "error": {"message": "queue is full", "type": "rate_limit_error", "param": None, "code": "queue_full"}
    }


# ---- chat requests -----------------------------------------------------------------------------


def test_chat_messages_for_the_template() -> None:
    req = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
             "name": "ann"},
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ]
    )  # fmt: skip
    assert req.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello\nthere", "name": "ann"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]


@pytest.mark.parametrize(
    ("fields", "expected_max_tokens"),
    [
        ({}, 16),
        ({"max_tokens": 5}, 5),
        ({"max_completion_tokens": 7}, 7),
        ({"max_tokens": 5, "max_completion_tokens": 7}, 7),
    ],
)  # fmt: skip
def test_chat_max_completion_tokens_wins(fields: dict[str, Any], expected_max_tokens: int) -> None:
    assert to_sampling_params(chat(**fields), default_max_tokens=16).max_tokens == expected_max_tokens


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 5}, 5)],
)
def test_chat_logprobs_map_to_top_count(fields: dict[str, Any], expected: int | None) -> None:
    assert to_sampling_params(chat(**fields), default_max_tokens=16).logprobs == expected


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"messages": []}, "messages", "messages must contain at least one message, got []"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role",
         "Invalid value for 'messages.0.role': "
         "Input should be 'system', 'developer', 'user', 'assistant' or 'tool', got \"bot\""),
        ({"messages": [{"role": "user"}]}, "messages.0.content", "Missing required parameter: 'messages.0.content'"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content",
         "content is required for role 'user'"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
         "Invalid value for 'messages.0.content': Input should be a valid string, got 5"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content",
         "only text content parts ({'type': 'text', 'text': ...}) are supported, got 'image_url'"),
        ({"messages": "hi"}, "messages", "Invalid value for 'messages': Input should be a valid array, got \"hi\""),
        ({"top_logprobs": 3}, "top_logprobs", "top_logprobs requires logprobs to be true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs",
         "Invalid value for 'top_logprobs': Input should be less than or equal to 20, got 21"),
        ({"logprobs": 2}, "logprobs", "Invalid value for 'logprobs': Input should be a valid boolean, got 2"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be at least 1, got 0"),
    ],
)  # fmt: skip
def test_chat_validation_errors_name_field_and_value(fields: dict[str, Any], param: str, message: str) -> None:
    err = rejected(ChatCompletionRequest, {"messages": USER_HI} | fields)
    assert (err.param, err.message) == (param, message)


def test_chat_accepts_text_response_format_and_empty_tools() -> None:
    assert chat(response_format={"type": "text"}, tools=[]).messages[0].content == "hi"


# ---- checks that need the model ----------------------------------------------------------------


def test_token_ids_outside_vocabulary_are_rejected() -> None:
    check_token_ids([0, 49151], vocab_size=49152, param="prompt")
    with pytest.raises(ApiError) as info:
        check_token_ids([5, 49152], vocab_size=49152, param="prompt")
    assert (info.value.param, info.value.message) == (
        "prompt",
        "token id 49152 in 'prompt' is outside the vocabulary (size 49152)",
    )
    with pytest.raises(ApiError, match="token id 49160 in 'prompt'"):  # the first one out, not the largest
        check_token_ids([5, 49160, 60000], vocab_size=49152, param="prompt")
    check_token_ids([], vocab_size=49152, param="prompt")


def test_context_length_exceeded() -> None:
    check_context_length(num_prompt_tokens=100, max_tokens=28, max_model_len=128, param="messages")
    with pytest.raises(ApiError) as info:
        check_context_length(num_prompt_tokens=100, max_tokens=29, max_model_len=128, param="messages")
    assert error_body(info.value) == {
        "error": {
            "message": "This model's maximum context length is 128 tokens. However, you requested 129 tokens "
            "(100 in the messages, 29 in the completion). Please reduce the length of the messages or completion.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
