"""The gateway's reading of output constraints and tools, and the tool-call stream, without a stack:
what each request field becomes, which are refused (and how), and that streamed argument deltas
join to exactly the arguments of the whole answer however the text is split."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.generation import ChoiceDelta
from services.gateway.openai_responses import Choice, ResponseMeta, Usage
from services.gateway.openai_schema import ApiError, ChatCompletionRequest
from services.gateway.structured import requested_spec
from services.gateway.tools import ToolChatFormat, ToolPlan, plan_tools
from shared.engine.constraint import StructuredSpec

USER_HI = [{"role": "user", "content": "hi"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
META = ResponseMeta("chatcmpl-1", "m", 0)


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER_HI} | fields)


def test_each_field_becomes_one_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases: list[tuple[dict[str, Any], StructuredSpec | None]] = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredSpec("json_object")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}},
         StructuredSpec("json_schema", json.dumps(schema))),
        ({"guided_json": json.dumps(schema)}, StructuredSpec("json_schema", json.dumps(schema))),
        ({"guided_regex": "[0-9]+"}, StructuredSpec("regex", "[0-9]+")),
        ({"guided_choice": ["a", "b"]}, StructuredSpec.choice(["a", "b"])),
        ({"guided_grammar": 'root ::= "x"'}, StructuredSpec("grammar", 'root ::= "x"')),
        ({"structured_outputs": {"regex": "a+"}}, StructuredSpec("regex", "a+")),
    ]  # fmt: skip
    for fields, expected in cases:
        found = requested_spec(chat(**fields))
        assert (found[0] if found else None) == expected, fields


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type", "response_format type 'yaml' is not supported"),
        ({"guided_json": {"type": "object", "if": {}}}, "guided_json", "unsupported keyword 'if' at #"),
        ({"guided_json": {"properties": {"a": {"oneOf": []}}}}, "guided_json", "not a valid JSON schema"),
        ({"guided_json": {"properties": {"a": {"uniqueItems": True}}}}, "guided_json",
         "unsupported keyword 'uniqueItems' at #/properties/a"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
        ({"guided_regex": "a", "guided_grammar": "b"}, "guided_grammar", "at most one output constraint"),
        ({"tool_choice": "required"}, "tool_choice", "no tools are given"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
         "names the function 'f', which is not among the tools (get_weather)"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is used twice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "1-64 letters"),
    ],
)  # fmt: skip
def test_bad_fields_are_refused_naming_the_field(fields: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(ApiError) as info:
        req = chat(**fields)
        requested_spec(req)
        plan_tools(req)
    assert info.value.status == 400 and info.value.param == param and message in info.value.message


def test_tool_choice_sets_the_constraint() -> None:
    assert plan_tools(chat(tools=[WEATHER], tool_choice="none")) is None
    auto = plan_tools(chat(tools=[WEATHER, CLOCK]))
    assert auto is not None and auto.spec() is None
    named = plan_tools(chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named is not None and named.spec() == StructuredSpec("json_schema", json.dumps(PARAMS))
    required = plan_tools(chat(tools=[WEATHER, CLOCK], tool_choice="required"))
    assert required is not None and required.spec() is not None
    branches = json.loads(required.spec().value)["anyOf"]  # type: ignore[union-attr]
    assert [b["properties"]["name"] for b in branches] == [{"const": "get_weather"}, {"const": "get_time"}]


def test_without_template_support_the_tools_go_in_the_system_message() -> None:
    plan = plan_tools(chat(tools=[WEATHER]))
    assert plan is not None
    messages = plan.prompt_messages([{"role": "system", "content": "Be brief."}, *USER_HI], knows_tools=False)
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call these functions:")
    assert '"get_weather"' in messages[0]["content"] and messages[1:] == USER_HI
    assert plan.prompt_messages(USER_HI, knows_tools=True) == USER_HI
    assert plan.template_tools(knows_tools=True) == [WEATHER | {"function": WEATHER["function"] | {"description": ""}}]


def streamed(plan: ToolPlan, text: str, piece: int, reason: str = "stop") -> list[dict[str, Any]]:
    fmt = ToolChatFormat(plan)
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    return [
        fmt.chunk(META, ChoiceDelta(0, p, None, reason if i == len(pieces) - 1 else None, 0, i == 0))["choices"][0]
        for i, p in enumerate(pieces)
    ]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 100])
def test_streamed_arguments_join_to_the_whole_answers_arguments(piece: int) -> None:
    plan = ToolPlan({"get_weather": plan_tools(chat(tools=[WEATHER])).functions["get_weather"]}, "required")  # type: ignore[union-attr]
    text = '{"name": "get_weather", "arguments": {"city": "Paris {x}"}}'
    choices = streamed(plan, text, piece)
    calls = [call for c in choices for call in c["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris {x}"}'
    assert choices[-1]["finish_reason"] == "tool_calls" and not any("content" in c["delta"] for c in choices)
    assert [c["delta"].get("role") for c in choices] == ["assistant"] + [None] * (len(choices) - 1)
    body = ToolChatFormat(plan).body(META, [Choice(0, text, "stop")], Usage(1, 1))
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["arguments"] == '{"city": "Paris {x}"}' and body["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_streams_plain_answers_as_content() -> None:
    plan = plan_tools(chat(tools=[WEATHER]))
    assert plan is not None
    choices = streamed(plan, "It is sunny in Paris.", 4)
    assert "".join(c["delta"].get("content", "") for c in choices) == "It is sunny in Paris."
    assert choices[-1]["finish_reason"] == "stop"
    tagged = streamed(plan, '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>', 5)
    calls = [call for c in tagged for call in c["delta"].get("tool_calls", [])]
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Oslo"}
