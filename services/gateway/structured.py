"""A request's output constraint: OpenAI's `response_format` and vLLM's `guided_*` / `structured_outputs`
fields turned into one StructuredSpec, checked here so that nothing that fails reaches a worker.

    response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}  -> json_schema
    response_format {"type": "json_object"}                                               -> json_object
    guided_json / guided_regex / guided_choice / guided_grammar                           -> json_schema / regex / choice / grammar
    structured_outputs {"json" | "regex" | "choice" | "grammar": ...}                     -> the same

A JSON schema must be valid (its draft's meta-schema) and use only the keywords that the grammar
enforces (SUPPORTED_KEYWORDS); anything else is a 400, as is a regex or grammar that does not compile.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jsonschema

from services.gateway.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest
from shared.engine.constraint import GrammarError, StructuredSpec

if TYPE_CHECKING:
    from shared.engine.structured import Grammars

# keywords that constrain, and that the grammar enforces exactly
CONSTRAINING_KEYWORDS = frozenset({
    "type", "enum", "const", "anyOf", "$ref", "properties", "required", "additionalProperties", "items",
    "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum",
})  # fmt: skip
# keywords that annotate or hold definitions
ANNOTATION_KEYWORDS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "$defs", "definitions",
})  # fmt: skip
SUPPORTED_KEYWORDS = CONSTRAINING_KEYWORDS | ANNOTATION_KEYWORDS
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "prefixItems")
_GUIDED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def requested_spec(req: CompletionRequest | ChatCompletionRequest) -> tuple[StructuredSpec, str] | None:
    """The constraint the request asks for and the field it came from; at most one may be given."""
    found: list[tuple[StructuredSpec, str]] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None and (spec := _from_response_format(response_format)) is not None:
        found.append((spec, "response_format"))
    for field, kind in _GUIDED_KINDS.items():
        if (value := getattr(req, field)) is not None:
            found.append((_spec(kind, value, field), field))
    if req.structured_outputs is not None:
        found.append(_from_structured_outputs(req.structured_outputs))
    if len(found) > 1:
        fields = ", ".join(field for _, field in found)
        raise ApiError(400, f"give at most one output constraint, got {fields}", param=found[1][1])
    return found[0] if found else None


def _from_response_format(response_format: dict[str, Any]) -> StructuredSpec | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise ApiError(400, "response_format.json_schema must be an object with a 'name' and a 'schema'",
                           param="response_format.json_schema")
        return _spec("json", body.get("schema", {}), "response_format.json_schema.schema")
    raise ApiError(400, f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
                        "'json_schema'", param="response_format.type")


def _from_structured_outputs(options: dict[str, Any]) -> tuple[StructuredSpec, str]:
    given = [key for key in _STRUCTURED_KINDS if options.get(key) is not None]
    if len(given) != 1:
        raise ApiError(400, f"structured_outputs needs exactly one of {sorted(_STRUCTURED_KINDS)}, got {given}",
                       param="structured_outputs")
    field = f"structured_outputs.{given[0]}"
    return _spec(given[0], options[given[0]], field), field


def _spec(kind: str, value: Any, field: str) -> StructuredSpec:
    if kind == "json":
        return StructuredSpec("json_schema", json.dumps(checked_schema(value, field)))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise ApiError(400, f"{field} must be a non-empty list of non-empty strings", param=field)
        return StructuredSpec.choice(value)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{field} must be a non-empty string", param=field)
    return StructuredSpec(_STRUCTURED_KINDS[kind], value)  # type: ignore[arg-type]


def checked_schema(schema: Any, field: str) -> dict[str, Any]:
    """The schema (given as an object or as JSON text), if valid and within the supported keywords."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"{field} is not valid JSON: {exc}", param=field) from exc
    if not isinstance(schema, dict):
        raise ApiError(400, f"{field} must be a JSON object, got {type(schema).__name__}", param=field)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ApiError(400, f"{field} is not a valid JSON schema: {exc.message}" + (f" (at {where})" if where else ""),
                       param=field) from exc
    _check_keywords(schema, field, "#")
    return schema


def _check_keywords(schema: Any, field: str, where: str) -> None:
    if not isinstance(schema, dict):
        return  # true / false schemas
    unsupported = sorted(set(schema) - SUPPORTED_KEYWORDS)
    if unsupported:
        raise ApiError(400, f"{field} uses the unsupported keyword {unsupported[0]!r} at {where}; supported: "
                            f"{', '.join(sorted(CONSTRAINING_KEYWORDS))}", param=field, code="unsupported_keyword")
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            _check_keywords(sub, field, f"{where}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            _check_keywords(sub, field, f"{where}/{key}/{i}")
    for key in ("items", "additionalProperties"):
        _check_keywords(schema.get(key), field, f"{where}/{key}")


async def checked_constraint(
    grammars: Callable[[], Grammars], req: CompletionRequest | ChatCompletionRequest, tool_spec: StructuredSpec | None
) -> StructuredSpec | None:
    """The request's one output constraint (its own, or the one its tool_choice implies), compiled once
    here so that a constraint that does not compile is a 400, not a failure on a worker."""
    requested = requested_spec(req)
    if requested is not None and tool_spec is not None:
        raise ApiError(400, f"{requested[1]} cannot be combined with tool_choice 'required' or a named function",
                       param=requested[1])
    spec, field = requested or (tool_spec, "tools")
    if spec is None:
        return None
    try:
        # in a thread: a large schema takes tens of ms; cached by spec
        await asyncio.to_thread(lambda: grammars().compile(spec))
    except GrammarError as exc:
        raise ApiError(400, f"{field}: {exc}", param=field, code="invalid_grammar") from exc
    return spec
