"""bench.kv_dtype: the KV cache's dtype at equal pool memory: capacity, speed and greedy agreement."""

from __future__ import annotations

from bench.report.model import Comparison, Documents, num, percent, table

STEP_PREFIX = "decode_step_ms_"


def body(docs: Documents) -> list[str]:
    lines: list[str] = []
    for doc in docs.values():
        results = doc["results"]
        first = next(iter(results.values()))
        contexts = [key.removeprefix(STEP_PREFIX) for key in first if key.startswith(STEP_PREFIX)]
        lines += [f"Model {doc['model_dtype'].removeprefix('torch.')}, a {doc['kv_bytes'] / 2**20:,.1f} MiB pool for "
                  f"every KV dtype, {doc['num_requests']} requests; agreement against the first row.", ""]
        header = ["KV dtype", "blocks", "peak running", "output tok/s", *(f"step ms @{int(c):,}" for c in contexts),
                  "handoff MiB", "greedy same before divergence", "logprob mean abs diff"]
        rows = [[kv_dtype if r["format"] == kv_dtype else f"{kv_dtype} ({r['format']})", str(r["blocks"]), str(r["peak_running"]), num(r["output_tokens_per_s"]),
                 *(num(r[STEP_PREFIX + c]) for c in contexts), num(r["handoff_bytes"] / 2**20),
                 percent(r.get("prefix_agreement")), num(r.get("logprob_mean_abs_diff"), 4)]
                for kv_dtype, r in results.items()]
        lines += table(header, rows)
    return lines


COMPARISON = Comparison(
    prefix="kv_dtype",
    title="KV cache dtype",
    what="`LLMD_KV_CACHE__DTYPE` at equal pool memory: blocks, requests running at once, decode step time by "
         "context, handoff size, and greedy agreement on the engine-parity prompts.",
    body=body,
)
