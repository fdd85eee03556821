"""What a comparison's renderer returns, and the number formats every section shares."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Document = dict[str, Any]
Documents = Mapping[str, Document]  # result name (file stem) -> its JSON, e.g. "handoff_tcp" -> {...}


@dataclass(frozen=True)
class Target:
    """One row of the targets table: `value` measured against `threshold`."""

    goal: str
    value: float
    threshold: float
    measured: str  # how the value reads on the page, with what it came from
    higher_is_better: bool = True

    @property
    def met(self) -> bool:
        return self.value >= self.threshold if self.higher_is_better else self.value <= self.threshold


@dataclass(frozen=True)
class SummaryRow:
    """A row of the summary table: one measure for this stack, vLLM's CPU build and transformers."""

    measure: str
    ours: str
    vllm: str = "-"
    transformers: str = "-"


@dataclass(frozen=True)
class Comparison:
    """One benchmark's section. Its results are `<prefix>.json` and `<prefix>_<variant>.json`
    (e.g. handoff_tcp, handoff_shm), each rendered by `body` into the section's lines."""

    prefix: str
    title: str
    what: str  # a sentence or two: what is compared, on what
    body: Callable[[Documents], list[str]]
    targets: Callable[[Documents], list[Target]] = field(default=lambda docs: [])
    summary: Callable[[Documents], list[SummaryRow]] = field(default=lambda docs: [])

    def claims(self, name: str) -> bool:
        return name == self.prefix or name.startswith(self.prefix + "_")


def table(header: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int = 1) -> list[str]:
    """A Markdown table: the first `text_columns` left-aligned, the others right-aligned (numbers)."""
    align = ["---"] * text_columns + ["---:"] * (len(header) - text_columns)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def num(value: float | None, digits: int = 1) -> str:
    """A figure with thousands separators; "-" where there is none."""
    return "-" if value is None else f"{value:,.{digits}f}"


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"
