"""The OpenAI API's request bodies and their errors (responses: openai_responses.py).

Requests are validated here and nowhere else; anything that passes `parse_request` and
`to_sampling_params` is safe to hand to the engine.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shared.engine.constraint import StructuredSpec
from shared.engine.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

MAX_N = 16
# torch.Generator.manual_seed accepts exactly this range.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
_MAX_SHOWN_INPUT = 80

FinishReason = Literal["stop", "length", "tool_calls"]
RequestT = TypeVar("RequestT", bound="_GenerationRequest")


# ---- errors -------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error the client sees as OpenAI's `{"error": {...}}` body with HTTP `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}  # e.g. Retry-After on 429, WWW-Authenticate on 401


def error_body(err: ApiError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def api_error_from_validation(exc: ValidationError) -> ApiError:
    """The first problem pydantic found, as a 400 naming the field and the offending value."""
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    kind, msg = first["type"], first["msg"]
    if kind == "json_invalid":
        return ApiError(400, f"Request body is not valid JSON: {first['ctx']['error']}")
    if kind == "model_type" and param is None:
        return ApiError(400, "Request body must be a JSON object")
    if kind == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'", param=param)
    if kind == "value_error":
        return ApiError(400, msg.removeprefix("Value error, "), param=param)
    return ApiError(400, f"Invalid value for '{param}': {msg}, got {_show(first['input'])}", param=param)


def _show(value: Any) -> str:
    shown = json.dumps(value, ensure_ascii=False, default=str)
    return shown if len(shown) <= _MAX_SHOWN_INPUT else shown[: _MAX_SHOWN_INPUT - 3] + "..."


def parse_request(model: type[RequestT], body: bytes | str) -> RequestT:
    """The JSON request body validated as `model`; raises ApiError (400) on any problem."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise api_error_from_validation(exc) from exc


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    if not token_ids or max(token_ids) < vocab_size:  # max runs in C: a long prompt checks in microseconds
        return
    token_id = next(t for t in token_ids if t >= vocab_size)
    message = f"token id {token_id} in '{param}' is outside the vocabulary (size {vocab_size})"
    raise ApiError(400, message, param=param)


def check_context_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int, param: str) -> None:
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {param}, {max_tokens} in the "
            f"completion). Please reduce the length of the {param} or completion.",
            param=param,
            code="context_length_exceeded",
        )


# ---- requests -----------------------------------------------------------------------------------

TokenId = Annotated[StrictInt, Field(ge=0)]
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "stop_token_ids", "ignore_eos", "min_tokens",
)  # fmt: skip


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _GenerationRequest(BaseModel):
    """Fields both endpoints share; null means "the default", as in OpenAI's API."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    seed: StrictInt | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    stop: list[StrictStr] = []
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    logit_bias: dict[str, Any] | None = None
    # output constraints as vLLM takes them (services/gateway/structured.py reads and checks them)
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, stop: Any) -> Any:
        if stop is None:
            return []
        if not isinstance(stop, (str, list)):
            raise ValueError(f"stop must be a string or a list of strings, got {_show(stop)}")
        return [stop] if isinstance(stop, str) else stop

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, bias: dict[str, Any] | None) -> dict[str, Any] | None:
        if bias:
            raise ValueError("logit_bias is not supported")
        return bias

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_kwargs(self) -> dict[str, Any]:
        kwargs = {name: value for name in _SAMPLING_FIELDS if (value := getattr(self, name)) is not None}
        if kwargs.get("top_k") in (0, -1):
            del kwargs["top_k"]  # vLLM's spelling of "no top-k filter"
        return kwargs | {"stop": self.stop}


class CompletionRequest(_GenerationRequest):
    """Body of POST /v1/completions. `prompt` is normalised to a list of prompts."""

    prompt: list[StrictStr | list[TokenId]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_as_list(cls, prompt: Any) -> Any:
        prompts = [prompt] if isinstance(prompt, str) or _is_token_ids(prompt) else prompt
        if not isinstance(prompts, list) or not all(isinstance(p, str) or _is_token_ids(p) for p in prompts):
            raise ValueError(f"prompt must be {_PROMPT_SHAPES}, got {_show(prompt)}")
        if not prompts or not all(prompts):
            raise ValueError(f"prompt must not be empty, got {_show(prompt)}")
        if negative := [t for p in prompts if not isinstance(p, str) for t in p if t < 0]:
            raise ValueError(f"prompt token ids must be non-negative, got {negative[0]}")
        return prompts

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError(f"best_of is not supported (got {best_of}); use n for several completions")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(token_id) is int for token_id in value)


class ChatMessage(BaseModel):
    """One message; `content` arrives as a string or text parts and is kept as one string."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls

    @field_validator("content", mode="before")
    @classmethod
    def _content_as_text(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and info.data.get("role") != "assistant":
            raise ValueError(f"content is required for role '{info.data.get('role')}'")
        if not isinstance(content, list):
            return content
        return "\n".join(_text_of_part(part) for part in content)

    def to_template(self) -> dict[str, Any]:
        # Chat templates know "system"; "developer" is OpenAI's newer name for it.
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.content or ""}
        extras = {"name": self.name, "tool_call_id": self.tool_call_id, "tool_calls": self.tool_calls}
        return message | {key: value for key, value in extras.items() if value is not None}


def _text_of_part(part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, got {kind!r}")
    text: str = part["text"]
    return text


class ChatCompletionRequest(_GenerationRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # services/gateway/tools.py reads and checks these
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must contain at least one message, got []")
        return messages

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.to_template() for message in self.messages]


class TokenizeRequest(BaseModel):
    """Body of POST /tokenize (vLLM's extension): a prompt, or chat messages rendered by the template."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if messages == []:
            raise ValueError("messages must contain at least one message, got []")
        return messages

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self

    def template_messages(self) -> list[dict[str, str]]:
        return [message.to_template() for message in self.messages or []]


class DetokenizeRequest(BaseModel):
    """Body of POST /detokenize (vLLM's extension)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[TokenId]


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest, default_max_tokens: int, structured: StructuredSpec | None = None
) -> SamplingParams:
    """The engine's view of `req`; out-of-range values raise ApiError (400) naming the request field.
    `structured`: the output constraint services.gateway.structured or .tools derived from it."""
    kwargs = req._sampling_kwargs() | {"structured": structured}
    max_tokens_field = "max_tokens"
    if isinstance(req, ChatCompletionRequest):
        if req.max_completion_tokens is not None:
            max_tokens_field = "max_completion_tokens"
        if req.logprobs:
            kwargs["logprobs"] = req.top_logprobs or 0
    elif req.logprobs is not None:
        kwargs["logprobs"] = req.logprobs
    requested = getattr(req, max_tokens_field)
    kwargs["max_tokens"] = default_max_tokens if requested is None else requested
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        if exc.param == "max_tokens" and max_tokens_field != "max_tokens":
            raise ApiError(400, max_tokens_field + str(exc).removeprefix("max_tokens"), param=max_tokens_field) from exc
        raise ApiError(400, str(exc), param=exc.param) from exc
