"""Structured outputs and tool calls through the real stack (gateway, 1 prefill, 2 decode workers) with
the official `openai` client: Pydantic parsing, json_object, vLLM's guided_* fields, tool calls whole
and streamed, 200 generated schemas, clear 400s, and a seeded constrained answer that is the same in
one engine, split across the workers, and after its decode worker is SIGKILLed mid-answer."""

from __future__ import annotations

import json
import random
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest
import redis
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field

from services.launcher import Stack
from shared.engine.constraint import StructuredSpec
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings
from tests.services.stacks import FAST_HEARTBEAT, request_holders, running_stack
from tests.services.test_faults import assert_clean

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KV_BYTES = 64 * 2**20
NUM_SCHEMAS = 96
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]},
    },
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 12}}, "required": ["timezone"]}}}
STORY = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                          "story": {"type": "string", "minLength": 100, "maxLength": 160}},
         "required": ["title", "story"]}  # fmt: skip
STORY_MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse, as JSON."}]


class City(BaseModel):
    name: str
    country: str
    population: int = Field(ge=0, le=99_999_999)  # unbounded, the small model writes digits until max_tokens


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    env = {"LLMD_KV_CACHE__MEMORY_BYTES": str(KV_BYTES), **FAST_HEARTBEAT}
    with running_stack("structured", env, num_prefill=1, num_decode=2) as stack:
        yield stack


def ask(client: OpenAI, model: str, content: str, max_tokens: int = 48, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, seed=1, **kwargs
    )


def test_parse_with_a_pydantic_model_returns_the_object(client: OpenAI, model: str) -> None:
    reply = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        max_tokens=64, temperature=0.0,
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and city.name and 0 <= city.population <= 99_999_999


def test_json_object_output_parses(client: OpenAI, model: str) -> None:
    reply = ask(client, model, "Describe a cat in JSON.", response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_vllm_guided_fields_constrain_the_output(client: OpenAI, model: str) -> None:
    regex = ask(client, model, "What is your phone number?", extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", regex.choices[0].message.content)
    choice = ask(client, model, "Is the sky blue?", extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")
    grammar = ask(client, model, "Count.", extra_body={"structured_outputs": {"grammar": 'root ::= ("one" | "two") "!"'}})
    assert grammar.choices[0].message.content in ("one!", "two!")
    completion = client.completions.create(model=model, prompt="My favourite colour is", max_tokens=8,
                                           extra_body={"guided_choice": ["red", "green"]})
    assert completion.choices[0].text in ("red", "green")


def test_a_named_function_is_called_with_valid_arguments(client: OpenAI, model: str) -> None:
    reply = ask(client, model, "What's the weather in Paris?", tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_streamed_required_tool_call_arrives_as_argument_deltas(client: OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], tools=[WEATHER, TIME],
        tool_choice="required", max_tokens=64, seed=3, stream=True,
    )  # fmt: skip
    choices = [chunk.choices[0] for chunk in stream if chunk.choices]
    deltas, reasons = [c.delta for c in choices], [c.finish_reason for c in choices]
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert calls[0].id and calls[0].function.name in ("get_weather", "get_time")
    assert len([c for c in calls if c.function.arguments]) > 1  # the arguments came in pieces
    arguments = json.loads("".join(c.function.arguments or "" for c in calls))
    tool = WEATHER if calls[0].function.name == "get_weather" else TIME
    jsonschema.validate(arguments, tool["function"]["parameters"])
    assert reasons[-1] == "tool_calls" and not any(delta.content for delta in deltas)


def test_bad_constraints_get_a_400_and_never_reach_a_worker(client: OpenAI, model: str) -> None:
    cases = {
        "invalid schema": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strng"}}}}}},
        "unsupported keyword": {"extra_body": {"guided_json": {"type": "object", "not": {"required": ["a"]}}}},
        "unknown tool": {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "bad grammar": {"extra_body": {"guided_grammar": "root ::= ("}},
        "bad regex": {"extra_body": {"guided_regex": "[a-"}},
        "two constraints": {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
    }
    for what, kwargs in cases.items():
        with pytest.raises(BadRequestError) as info:
            ask(client, model, "Hi.", **kwargs)
        error = info.value.body
        assert isinstance(error, dict) and error["type"] == "invalid_request_error" and error["message"], what
        assert error["param"], what


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A schema within the supported keywords, small enough to be answered in a few dozen tokens."""
    kinds = ["string", "integer", "number", "boolean", "enum", "const", "null"]
    if depth < 2:
        kinds += ["object", "object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        schema: dict[str, Any] = {"type": "string", "maxLength": rng.randint(1, 12)}
        if rng.random() < 0.3:
            schema = {"type": "string", "pattern": rng.choice(["^[a-z]+$", "^[0-9]{2,4}$", "^[A-Z][a-z]*$"])}
        return schema
    if kind in ("integer", "number"):
        low = rng.randint(-50, 50)
        return {"type": kind, "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "enum":
        return {"enum": rng.sample(["a", "b", 1, 2.5, True, None, "long value"], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["x", 7, False])}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low, "maxItems": low + 2}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    names = rng.sample(["id", "name", "tags", "size", "ok", "kind", "value"], rng.randint(1, 3))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def test_generated_schemas_are_always_met_when_the_answer_ends(client: OpenAI, model: str) -> None:
    rng = random.Random(2024)
    schemas = [{"type": "object", "properties": {"answer": random_schema(rng)}, "required": ["answer"]}
               for _ in range(NUM_SCHEMAS)]  # fmt: skip

    def answer(schema: dict[str, Any]) -> tuple[str, str]:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=40, temperature=0.8,
            extra_body={"guided_json": schema},
        )  # fmt: skip
        return reply.choices[0].finish_reason, reply.choices[0].message.content

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(answer, schemas))
    stopped = [(schema, text) for schema, (reason, text) in zip(schemas, results) if reason == "stop"]
    for schema, text in stopped:
        jsonschema.validate(json.loads(text), schema)
    assert len(stopped) >= NUM_SCHEMAS // 2, f"only {len(stopped)} of {NUM_SCHEMAS} answers ended within 40 tokens"


def seeded_story(client: OpenAI, model: str, on_chunk: Any = lambda n: None) -> str:
    stream = client.chat.completions.create(
        model=model, messages=STORY_MESSAGES, max_tokens=80, temperature=1.0, seed=21, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "story", "schema": STORY}},
    )  # fmt: skip
    text, num_chunks = "", 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            num_chunks += 1
            on_chunk(num_chunks)
    return text


def test_a_seeded_constrained_answer_is_the_same_in_one_engine_split_and_after_a_kill(
    client: OpenAI, model: str, stack: Stack, rds: redis.Redis, model_path: str
) -> None:
    split = seeded_story(client, model)
    victims: list[str] = []

    def kill_holder(num_chunks: int) -> None:
        if num_chunks == 6 and not victims:
            [holder] = request_holders(rds, stack.keys, "decode")
            victims.append(holder)
            assert stack.stop_worker(holder, signal.SIGKILL) < 0

    killed = seeded_story(client, model, kill_holder)
    assert victims and killed == split
    assert_clean(rds, stack.keys)
    stack.add_worker("decode")

    llm = LLM(settings=EngineSettings(model=ModelSettings(path=model_path, dtype="float32", device="cpu"),
                                      kv_cache=KVCacheSettings(memory_bytes=KV_BYTES)))  # fmt: skip
    prompt = llm.tokenizer.apply_chat_template(STORY_MESSAGES)
    spec = StructuredSpec("json_schema", json.dumps(STORY))
    [one] = llm.generate([prompt], SamplingParams(max_tokens=80, temperature=1.0, seed=21, structured=spec))
    assert one.text == split
