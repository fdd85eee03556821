"""bench.side_by_side: the same serving workload against this stack, vLLM's CPU build and transformers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from bench.report.model import Comparison, Document, Documents, SummaryRow, Target, num, ratio, table

OURS = "this stack"  # how bench.side_by_side labels this project's run
VLLM = "vLLM"
TRANSFORMERS_FACTOR = 5.0  # the issue's: at least 5x transformers' static batching
VLLM_FACTOR = 1.0  # at or above vLLM's CPU build


def body(docs: Documents) -> list[str]:
    lines: list[str] = []
    for doc in docs.values():
        c = doc["config"]
        rate = "all at once" if c["request_rate"] == float("inf") else f"at {c['request_rate']:g}/s"
        lines += [f"Workload `{c['workload']}`, {c['num_prompts']} prompts {rate}, `ignore_eos`.", ""]
        rows = [[label, num(m["output_throughput"], 2), _spread(run), _s(m["ttft_ms"], "mean"),
                 f"{_ms(m['itl_ms'], 'p50')} / {_ms(m['itl_ms'], 'p99')}"]
                for label, run, m in ((label, run, run["metrics"]) for label, run in doc["runs"].items())]
        hf = doc.get("transformers")
        if hf is not None:
            rows.append([f"transformers `generate`, static batches of {hf['batch_size']}",
                         num(hf["output_throughput"], 2), "", "", ""])
        lines += table(["server", "output tok/s", "runs' range", "TTFT mean (s)", "ITL p50 / p99 (ms)"], rows)
        lines += ["", "Each server's figures are those of its run of median output throughput."]
    return lines


def summary(docs: Documents) -> list[SummaryRow]:
    rows = []
    for name, _, ours, vllm, hf in _compared(docs):
        rows += [
            SummaryRow(f"serving, output tok/s ({name})", num(ours["output_throughput"], 2),
                       "-" if vllm is None else num(vllm["output_throughput"], 2),
                       "-" if hf is None else num(hf["output_throughput"], 2)),
            SummaryRow(f"serving, TTFT mean s ({name})", _s(ours["ttft_ms"], "mean"),
                       "-" if vllm is None else _s(vllm["ttft_ms"], "mean")),
            SummaryRow(f"serving, ITL p99 ms ({name})", _ms(ours["itl_ms"], "p99"),
                       "-" if vllm is None else _ms(vllm["itl_ms"], "p99")),
        ]
    return rows


def targets(docs: Documents) -> list[Target]:
    found = []
    for name, doc, ours, vllm, hf in _compared(docs):
        tps = ours["output_throughput"]
        if hf is not None:
            found.append(Target(f"output throughput at least {TRANSFORMERS_FACTOR:g}x transformers' static batching",
                                tps / hf["output_throughput"], TRANSFORMERS_FACTOR,
                                f"{ratio(tps / hf['output_throughput'])} ({name}, {doc['config']['workload']})"))
        if vllm is not None:
            ranges = [_spread(_run(doc, start) or {}) for start in (OURS, VLLM)]
            spans = "" if "-" in ranges else f"; runs {ranges[0]} vs {ranges[1]} tok/s"
            found.append(Target("output throughput at or above vLLM's CPU build on the same workload",
                                tps / vllm["output_throughput"], VLLM_FACTOR,
                                f"{ratio(tps / vllm['output_throughput'])} ({name}, {doc['config']['workload']}{spans})"))
    return found


Metrics = dict[str, Any]


def _compared(docs: Documents) -> Iterator[tuple[str, Document, Metrics, Metrics | None, Metrics | None]]:
    """Each result with a run of this stack: its name, the document, and this stack's, vLLM's and
    transformers' metrics (None where that one did not run)."""
    for name, doc in docs.items():
        ours = _run(doc, OURS)
        if ours is not None:
            vllm = _run(doc, VLLM)
            yield name, doc, ours["metrics"], None if vllm is None else vllm["metrics"], doc.get("transformers")


def _run(doc: Document, label_start: str) -> dict[str, Any] | None:
    """The run whose label starts with `label_start`, e.g. "vLLM CPU 0.32.0"."""
    return next((run for label, run in doc["runs"].items() if label.startswith(label_start)), None)


def _spread(run: dict[str, Any]) -> str:
    """The range of a server's runs' output throughput; "-" in results that kept one run."""
    runs = run.get("output_throughput_runs")
    return "-" if not runs else f"{num(min(runs), 2)}-{num(max(runs), 2)}"


def _s(dist: dict[str, Any] | None, key: str) -> str:
    return "-" if dist is None else num(dist[key] / 1000)


def _ms(dist: dict[str, Any] | None, key: str) -> str:
    return "-" if dist is None else num(dist["percentiles"][key])


COMPARISON = Comparison(
    prefix="side_by_side",
    title="Serving beside vLLM and transformers",
    what="The whole stack over HTTP and vLLM's CPU build (same weights and dtype, all cores) on the same seeded "
         "prompts, one server after the other; transformers `generate` on them in static batches.",
    body=body,
    summary=summary,
    targets=targets,
)
