"""bench.overhead: rendered generically, as the benchmark is new: its `table` of columns and rows
(and its `description`, if it has one)."""

from __future__ import annotations

from bench.report.model import Comparison, Documents, table


def body(docs: Documents) -> list[str]:
    lines: list[str] = []
    for name, doc in docs.items():
        if doc.get("description"):
            lines += [str(doc["description"]), ""]
        found = doc.get("table")
        if isinstance(found, dict) and found.get("columns") and found.get("rows") is not None:
            lines += table([str(c) for c in found["columns"]], [[_cell(v) for v in row] for row in found["rows"]])
        else:
            lines.append(f"{name}.json has no `table` of `columns` and `rows` to show.")
    return lines


def _cell(value: object) -> str:
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


COMPARISON = Comparison(
    prefix="overhead",
    title="The serving stack's overhead",
    what="What the gateway, the streams and the workers add to the engine alone.",
    body=body,
)
