"""bench.overhead: the burst's table, the concurrency sweep and the phases, as the benchmark prints them."""

from __future__ import annotations

from bench.report.model import Comparison, Documents


def body(docs: Documents) -> list[str]:
    from bench.overhead import render  # the benchmark's own tables, not a second copy of them

    lines: list[str] = []
    for name, doc in docs.items():
        if not isinstance(doc.get("table"), list):
            lines.append(f"{name}.json has no `table` of rows to show.")
            continue
        lines += render(doc["table"], doc.get("sweep", []), doc.get("phases", [])).splitlines()
    return lines


COMPARISON = Comparison(
    prefix="overhead",
    title="The serving stack's overhead",
    what="What the gateway, the streams and the workers add to the engine alone, on a tiny random-weight "
         "model whose compute is almost nothing: output tokens/s, and CPU time per output token by process.",
    body=body,
)
