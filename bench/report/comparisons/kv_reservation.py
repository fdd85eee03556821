"""bench.kv_reservation: paged KV blocks vs reserving each request's maximum length."""

from __future__ import annotations

from bench.report.model import Comparison, Documents, num, percent, table


def body(docs: Documents) -> list[str]:
    lines: list[str] = []
    for doc in docs.values():
        pool, workload = doc["kv_pool"], doc["workload"]
        lines += [f"A pool of {pool['tokens']:,} tokens ({pool['bytes'] / 2**20:,.1f} MiB, "
                  f"{doc['dtype'].removeprefix('torch.')}), {workload['num_requests']} requests.", ""]
        lines += table(
            ["KV reservation", "peak running", "mean running", "mean KV utilisation", "preemptions", "output tok/s"],
            [[policy, str(r["peak_running"]), num(r["mean_running"]), percent(r["kv_utilization"]),
              str(r["preemptions"]), num(r["tokens_per_s"])] for policy, r in doc["policies"].items()],
        )
    return lines


COMPARISON = Comparison(
    prefix="kv_reservation",
    title="Paged KV vs reserving each request's maximum length",
    what="The same engine and KV pool taking blocks as each request grows (`paged`), or reserving prompt + "
         "`max_tokens` at admission (`max_length`, as servers did before PagedAttention).",
    body=body,
)
