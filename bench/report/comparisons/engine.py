"""bench.engine: continuous vs static batching in one process, beside transformers."""

from __future__ import annotations

from bench.report.model import Comparison, Documents, SummaryRow, num, percent, ratio, table


def body(docs: Documents) -> list[str]:
    lines: list[str] = []
    for doc in docs.values():
        workload, static = doc["workload"], doc["engine_static"]
        hf = doc.get("transformers_static")
        batch = static["batch_size"]
        lines += [f"{workload['num_requests']} requests, prompts of {_span(workload['prompt_lens'])} tokens, outputs "
                  f"of {_span(workload['output_lens'])}, {doc['dtype'].removeprefix('torch.')}.", ""]
        rows = [["this engine, continuous batching (paged KV)", num(doc["engine"]["tokens_per_s"]),
                 ratio(doc.get("speedup"))],
                [f"this engine, static batches of {batch}", num(static["tokens_per_s"]),
                 ratio(doc.get("static_over_transformers"))]]
        if hf is not None:
            rows.append([f"transformers `generate`, static batches of {batch}", num(hf["tokens_per_s"]), "1.00x"])
        lines += table(["engine", "output tok/s", "vs transformers"], rows)
        lines += ["", f"Continuous over static batching: {ratio(doc['continuous_over_static'])}; KV utilisation "
                      f"(live / allocated slots) {percent(doc['engine']['kv_utilization'])} paged against "
                      f"{percent(doc['engine']['reserved_kv_utilization'])} had each request reserved its maximum."]
    return lines


def summary(docs: Documents) -> list[SummaryRow]:
    rows = []
    for name, doc in docs.items():
        hf = doc.get("transformers_static")
        rows.append(SummaryRow(f"engine alone, output tok/s ({name})", num(doc["engine"]["tokens_per_s"]),
                               transformers="-" if hf is None else num(hf["tokens_per_s"])))
    return rows


def _span(lens: list[int]) -> str:
    return f"{lens[0]:,}-{lens[1]:,}"


COMPARISON = Comparison(
    prefix="engine",
    title="Continuous vs static batching in one process",
    what="The engine alone, offline, on seeded random-token requests with `ignore_eos`: continuous batching, "
         "static batches of the same engine, and transformers `generate` on the same batches.",
    body=body,
    summary=summary,
)
