"""bench.interference: short requests' inter-token gaps while a burst of long prompts arrives,
disaggregated against colocated."""

from __future__ import annotations

from typing import Any

from bench.interference import TARGET_RATIO
from bench.report.model import Comparison, Document, Documents, Target, num, ratio, table

GAP_SETS = (("itl_ms", "all gaps"), ("itl_after_first_gap_ms", "after each request's first"))


def body(docs: Documents) -> list[str]:
    lines: list[str] = []
    for doc in docs.values():
        c = doc["config"]
        lines += [f"{c['num_short']} short requests ({c['short_input_len']}-token prompts, {c['short_min_tokens']}-"
                  f"{c['short_max_tokens']} output tokens) at {c['rate']:g}/s, amid them {c['num_long']} prompts of "
                  f"{c['long_input_len']:,} tokens at once; KV transport `{c['kv_transport']}`.", ""]
        rows = []
        for mode, result in doc["modes"].items():
            ttft = result["long"]["ttft_ms"]
            for key, label in GAP_SETS:
                itl = result["short"][key]
                rows.append([mode, label, f"{_p(itl['no_burst'], 'p50')} / {_p(itl['during_burst'], 'p50')}",
                             f"{_p(itl['no_burst'], 'p99')} / {_p(itl['during_burst'], 'p99')}",
                             ratio(itl["ratio"]["p99"]),
                             # the long prompts' TTFT belongs to the mode: once, on its first row
                             f"{_p(ttft, 'p50')} / {_p(ttft, 'p100')}" if key == "itl_ms" else ""])
        lines += table(["mode", "short-request ITL", "p50 no burst / burst (ms)", "p99 no burst / burst (ms)",
                        "p99 ratio", "long-prompt TTFT p50 / max (ms)"], rows, text_columns=2)
    return lines


def targets(docs: Documents) -> list[Target]:
    found = []
    for name, doc in docs.items():
        split = _p99_ratio(doc, "disaggregated")
        if split is None:
            continue
        colocated = _p99_ratio(doc, "colocated")
        beside = "" if colocated is None else f", colocated {ratio(colocated)}"
        found.append(Target(f"decode ITL p99 during a long-prompt burst within {TARGET_RATIO:g}x of no burst, "
                            f"disaggregated, KV over `{doc['config']['kv_transport']}`",
                            split, TARGET_RATIO, f"{ratio(split)}{beside} ({name})", higher_is_better=False))
    return found


def _p99_ratio(doc: Document, mode: str) -> float | None:
    result = doc["modes"].get(mode)
    return None if result is None else result["short"]["itl_ms"]["ratio"]["p99"]


def _p(dist: dict[str, Any] | None, key: str) -> str:
    return "-" if dist is None else num(dist["percentiles"][key], 0)


COMPARISON = Comparison(
    prefix="interference",
    title="Long prompts beside a steady stream: disaggregated vs colocated",
    what="What the split is for. Disaggregated: a prefill worker on one core, a decode worker on the other. "
         "Colocated: one engine on both cores, chunked prefill. The short requests' gaps inside the burst window "
         "against those outside it.",
    body=body,
    targets=targets,
)
