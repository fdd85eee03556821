"""Function calling: `tools` and `tool_choice` to a prompt and an output constraint, and the answer's
text back to `tool_calls`, whole or streamed as OpenAI streams them (argument deltas).

    tool_choice  constraint on the output                          the answer
    none         none; the tools are left out of the prompt       text
    auto         none                                             tool_calls if the text is a call, else text
    required     {"name": <one of the tools>, "arguments": {...}} tool_calls
    {function}   that function's parameters schema                tool_calls (the text is the arguments)

A chat template that knows tools renders them itself (and its model may wrap a call in
`<tool_call>...</tool_call>`, which the parser accepts). For one that does not (the default SmolLM2),
a system message lists the functions and asks for a call as `{"name": ..., "arguments": {...}}`.
One call per answer; `parallel_tool_calls` is accepted and has no other effect.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from services.gateway.formats import ChatFormat
from services.gateway.generation import ChoiceDelta
from services.gateway.openai_responses import (
    Choice,
    ResponseMeta,
    Usage,
    chat_chunk,
    chat_completion_body,
    chat_logprobs,
)
from services.gateway.openai_schema import ApiError, ChatCompletionRequest
from services.gateway.structured import checked_schema
from shared.engine.constraint import StructuredSpec

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# the start of a call as the constraint writes it; a model may put it in <tool_call> tags
_CALL_HEAD = re.compile(r'\s*(?:<tool_call>\s*)?\{\s*"name"\s*:\s*"(?P<name>[^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_CALL_TAIL = re.compile(r"\s*\}\s*(?:</tool_call>)?\s*$")
_HELD_BACK = re.compile(r"[\s}]*(?:</?t[a-z_]*>?)?\s*$")  # what may yet turn out to be the call's closing text
_PROMPT = (
    "You can call these functions:\n{functions}\n"
    'To call one, answer with only a JSON object: {{"name": <the function\'s name>, "arguments": <an object '
    "of its arguments>}}. Otherwise answer as usual."
)


@dataclass(slots=True, frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(slots=True, frozen=True)
class ToolPlan:
    """The tools of one chat request and how the answer may use them."""

    functions: dict[str, Function]
    choice: str  # "auto", "required" or a function's name

    @property
    def forced(self) -> Function | None:
        return self.functions.get(self.choice)

    def spec(self) -> StructuredSpec | None:
        if self.forced is not None:
            return StructuredSpec("json_schema", json.dumps(self.forced.parameters))
        if self.choice != "required":
            return None
        calls = [
            {"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
             "required": ["name", "arguments"], "additionalProperties": False}
            for f in self.functions.values()
        ]  # fmt: skip
        return StructuredSpec("json_schema", json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls}))

    def template_tools(self, knows_tools: bool) -> list[dict[str, Any]] | None:
        return [f.to_openai() for f in self.functions.values()] if knows_tools else None

    def prompt_messages(self, messages: list[dict[str, Any]], knows_tools: bool) -> list[dict[str, Any]]:
        """The messages with the functions described in the system message (unless the template does it),
        and earlier calls written the way this format asks for them."""
        messages = [_plain_call_message(m) if m.get("tool_calls") and not knows_tools else m for m in messages]
        if knows_tools:
            return messages
        listing = json.dumps([f.to_openai()["function"] for f in self.functions.values()], ensure_ascii=False)
        text = _PROMPT.format(functions=listing)
        if messages and messages[0]["role"] == "system":
            return [messages[0] | {"content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def call_in(self, text: str) -> tuple[str, str] | None:
        """(function name, arguments as JSON text) if the answer is a call."""
        if self.forced is not None:
            return self.forced.name, text
        head = _CALL_HEAD.match(text)
        if head is not None and head["name"] in self.functions:
            arguments = _CALL_TAIL.sub("", text[head.end():])
            if _is_object(arguments):
                return head["name"], arguments
        try:  # keys in another order, say
            call = json.loads(re.sub(r"</?tool_call>", "", text))
        except json.JSONDecodeError:
            return None
        if isinstance(call, dict) and call.get("name") in self.functions and isinstance(call.get("arguments"), dict):
            return call["name"], json.dumps(call["arguments"], ensure_ascii=False)
        return None


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _plain_call_message(message: dict[str, Any]) -> dict[str, Any]:
    calls = [call.get("function", {}) for call in message["tool_calls"]]
    text = "\n".join(json.dumps({"name": c.get("name"), "arguments": _arguments(c)}, ensure_ascii=False)
                     for c in calls)
    return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": text}


def _arguments(function: dict[str, Any]) -> Any:
    try:
        return json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        return function.get("arguments")


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools, checked (400s name the field); None without tools or with tool_choice none."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice is set but no tools are given", param="tool_choice")
        return None
    functions: dict[str, Function] = {}
    for i, tool in enumerate(req.tools):
        function = _function(tool, f"tools[{i}]")
        if function.name in functions:
            raise ApiError(400, f"tools[{i}]: the function name {function.name!r} is used twice", param="tools")
        functions[function.name] = function
    choice = _choice(req.tool_choice, functions)
    return None if choice == "none" else ToolPlan(functions, choice)


def _function(tool: Any, where: str) -> Function:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ApiError(400, f"{where} must be {{'type': 'function', 'function': {{...}}}}", param=where)
    body = tool["function"]
    name = body.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ApiError(400, f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                       param=f"{where}.function.name")
    parameters = body.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    description = body.get("description") or ""
    if not isinstance(description, str):
        raise ApiError(400, f"{where}.function.description must be a string", param=f"{where}.function.description")
    return Function(name, description, checked_schema(parameters, f"{where}.function.parameters"))


def _choice(tool_choice: str | dict[str, Any] | None, functions: dict[str, Function]) -> str:
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ApiError(400, f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}",
                           param="tool_choice")
        return tool_choice
    name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
    if name not in functions:
        raise ApiError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                            f"({', '.join(functions)})", param="tool_choice")
    return str(name)


# ---- the answer ---------------------------------------------------------------------------------


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name,
                                                                                      "arguments": arguments}}


@dataclass(slots=True)
class _CallStream:
    """One choice's streamed call: text is held until it is known to be a call (or not), then the
    arguments go out as they come, less a tail that may be the call's closing brace."""

    plan: ToolPlan
    text: str = ""
    name: str | None = None
    arguments_at: int = 0  # where the arguments start in text
    num_sent: int = 0  # characters of the arguments already sent
    is_open: bool = False  # the call's first delta (id and name) went out
    is_content: bool = False

    def delta(self, new_text: str, finished: bool) -> dict[str, Any]:
        self.text += new_text
        if self.is_content:
            return {"content": new_text} if new_text else {}
        if self.name is not None:
            return self._arguments(self._arguments_so_far(finished))
        if (forced := self.plan.forced) is not None:
            self.name = forced.name
            return self._arguments(self.text)
        head = _CALL_HEAD.match(self.text)
        if head is not None and head["name"] in self.plan.functions:
            self.name, self.arguments_at = head["name"], head.end()
            return self._arguments(self._arguments_so_far(finished))
        if finished and (call := self.plan.call_in(self.text)) is not None:  # keys in another order, say
            self.name = call[0]
            return self._arguments(call[1])
        if finished or not _may_be_call(self.text):
            self.is_content = True
            return {"content": self.text} if self.text else {}
        return {}

    def _arguments_so_far(self, finished: bool) -> str:
        arguments = self.text[self.arguments_at:]
        if self.plan.forced is not None:
            return arguments
        if finished:
            return _CALL_TAIL.sub("", arguments)
        held = _HELD_BACK.search(arguments)
        return arguments[: held.start()] if held is not None else arguments

    def _arguments(self, arguments: str) -> dict[str, Any]:
        new = arguments[self.num_sent:]
        self.num_sent += len(new)
        if not self.is_open:
            self.is_open = True
            return {"tool_calls": [{"index": 0} | tool_call(str(self.name), new)]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": new}}]} if new else {}


def _may_be_call(text: str) -> bool:
    stripped = text.lstrip()
    return stripped.startswith(("{", "<tool_call>")) or "<tool_call>".startswith(stripped)


class ToolChatFormat(ChatFormat):
    """The chat format of a request with tools: calls in the body and in the stream."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._streams: dict[int, _CallStream] = {}

    def body(self, meta: ResponseMeta, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        return chat_completion_body(meta, [self._with_call(c) for c in choices], usage)

    def _with_call(self, choice: Choice) -> Choice:
        call = self._plan.call_in(choice.text)
        if call is None:
            return choice
        reason = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
        return Choice(choice.index, "", reason, choice.logprobs, [tool_call(*call)])

    def chunk(self, meta: ResponseMeta, delta: ChoiceDelta) -> dict[str, Any]:
        stream = self._streams.setdefault(delta.index, _CallStream(self._plan))
        content = stream.delta(delta.text, delta.finish_reason is not None)
        if delta.is_first:  # the role goes out with the first token, as in ChatFormat
            content = {"role": "assistant"} | content
        reason = delta.finish_reason
        if reason == "stop" and stream.name is not None:
            reason = "tool_calls"
        logprobs = None if delta.logprobs is None else chat_logprobs(delta.logprobs)
        return chat_chunk(meta, delta.index, content, reason, logprobs)
