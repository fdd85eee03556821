"""What a structured output must match: the constraint that travels in SamplingParams (and so
in every message that carries a request's params). Compiling it is shared/engine/structured.py's job."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class GrammarError(ValueError):
    """A constraint cannot be compiled; the message names the problem."""


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """What the output must match. `value`: the JSON schema as JSON text (json_schema), a regular
    expression (regex), a JSON list of strings (choice), an EBNF grammar with a `root` rule
    (grammar), or "" (json_object: any JSON object)."""

    kind: ConstraintKind
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in get_args(ConstraintKind):
            raise GrammarError(f"unknown constraint kind {self.kind!r}; expected one of {get_args(ConstraintKind)}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredSpec:
        return cls(kind=data["kind"], value=data.get("value", ""))

    @classmethod
    def choice(cls, options: Sequence[str]) -> StructuredSpec:
        return cls("choice", json.dumps(list(options)))
