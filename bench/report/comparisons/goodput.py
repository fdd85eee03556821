"""bench.goodput: the share of requests meeting a TTFT and an inter-token target, by request rate."""

from __future__ import annotations

from bench.report.model import Comparison, Documents, SummaryRow, Target, num, percent, ratio, table

OURS = "disaggregated"
VLLM = "vLLM"
TARGET_FACTOR = 1.5  # the issue's: goodput at least 1.5x vLLM's CPU build


def body(docs: Documents) -> list[str]:
    lines: list[str] = []
    for doc in docs.values():
        t, runs = doc["targets"], doc["runs"]
        share = doc["config"]["share"]
        lines += [f"Targets: TTFT {num(t['ttft_ms'], 0)} ms, inter-token ({t['itl_measure']}) "
                  f"{num(t['itl_ms'], 0)} ms; "
                  f"goodput: the highest rate up to which at least {share:.0%} of requests meet both.", ""]
        rates = sorted({p["request_rate"] for points in runs.values() for p in points})
        both = {label: {p["request_rate"]: p["both"] for p in points} for label, points in runs.items()}
        rows = [[f"{rate:g}", *(percent(both[label].get(rate)) for label in runs)] for rate in rates]
        rows.append(["goodput (req/s)", *(_rate(doc["goodput"].get(label)) for label in runs)])
        lines += table(["req/s: met both", *runs], rows)
    return lines


def summary(docs: Documents) -> list[SummaryRow]:
    rows = []
    for name, doc in docs.items():
        ours, vllm = _goodput(doc["goodput"], OURS), _goodput(doc["goodput"], VLLM)
        if ours is not None:
            rows.append(SummaryRow(f"goodput req/s ({name})", _rate(ours[1]), "-" if vllm is None else _rate(vllm[1])))
    return rows


def targets(docs: Documents) -> list[Target]:
    found = []
    for name, doc in docs.items():
        ours, vllm = _goodput(doc["goodput"], OURS), _goodput(doc["goodput"], VLLM)
        if ours is None or vllm is None or not vllm[1]:
            continue  # no vLLM run, or vLLM met the share at no rate: no ratio to show
        value = (ours[1] or 0.0) / vllm[1]
        found.append(Target(f"goodput under latency targets at least {TARGET_FACTOR:g}x vLLM's CPU build", value,
                            TARGET_FACTOR, f"{ratio(value)}: {_rate(ours[1])} vs {_rate(vllm[1])} req/s ({name})"))
    return found


def _goodput(goodputs: dict[str, float | None], label_start: str) -> tuple[str, float | None] | None:
    return next(((label, rate) for label, rate in goodputs.items() if label.startswith(label_start)), None)


def _rate(rate: float | None) -> str:
    return "below the lowest rate" if rate is None else f"{rate:g}"


COMPARISON = Comparison(
    prefix="goodput",
    title="Goodput under latency targets",
    what="Poisson arrivals of chat-like requests, rate by rate, against targets set from the unloaded stack "
         "(or given); each server in turn.",
    body=body,
    summary=summary,
    targets=targets,
)
