"""bench.overhead: the burst's table, the concurrency sweep and the phases, as the benchmark prints them."""

from __future__ import annotations

from typing import Any

from bench.report.model import Comparison, Documents, SummaryRow, Target, num, ratio

ENGINE, STACK = "this engine alone", "this stack"
VLLM_ENGINE, VLLM_SERVER = "vLLM engine alone", "vLLM server"
STACK_SHARE = 0.85  # the stack keeps at least this share of its own engine's throughput
SERVER_FACTOR = 1.2  # and serves at least this many times vLLM's server


def body(docs: Documents) -> list[str]:
    from bench.overhead import render  # the benchmark's own tables, not a second copy of them

    lines: list[str] = []
    for name, doc in docs.items():
        if not isinstance(doc.get("table"), list):
            lines.append(f"{name}.json has no `table` of rows to show.")
            continue
        lines += render(doc["table"], doc.get("sweep", []), doc.get("phases", [])).splitlines()
    return lines


def _rows(docs: Documents) -> dict[str, dict[str, Any]]:
    return {row["row"]: row for doc in docs.values() if isinstance(doc.get("table"), list) for row in doc["table"]}


def summary(docs: Documents) -> list[SummaryRow]:
    rows = _rows(docs)
    found = []
    for measure, ours, theirs in (("engine alone", ENGINE, VLLM_ENGINE), ("serving", STACK, VLLM_SERVER)):
        if ours in rows:
            vllm = rows.get(theirs)
            found += [
                SummaryRow(f"{measure}, tiny model, output tok/s", num(rows[ours]["output_tok_s"], 0),
                           "-" if vllm is None else num(vllm["output_tok_s"], 0)),
                SummaryRow(f"{measure}, tiny model, CPU µs per output token", num(rows[ours]["cpu_us_per_token"], 0),
                           "-" if vllm is None else num(vllm["cpu_us_per_token"], 0)),
            ]
    return found


def targets(docs: Documents) -> list[Target]:
    rows = _rows(docs)
    found = []
    engine, stack = rows.get(ENGINE), rows.get(STACK)
    vllm_engine, vllm_server = rows.get(VLLM_ENGINE), rows.get(VLLM_SERVER)
    if engine is not None and vllm_engine is not None:
        value = engine["output_tok_s"] / vllm_engine["output_tok_s"]
        found.append(Target("tiny model: this engine alone at least level with vLLM's engine alone", value, 1.0,
                            f"{ratio(value)} ({num(engine['output_tok_s'], 0)} vs {num(vllm_engine['output_tok_s'], 0)} tok/s"
                            f"{_ranges(engine, vllm_engine)})"))
    if engine is not None and stack is not None:
        value = stack["output_tok_s"] / engine["output_tok_s"]
        found.append(Target(f"tiny model: the stack keeps at least {STACK_SHARE:.0%} of its engine's throughput", value,
                            STACK_SHARE, f"{value:.0%}{_ceiling(docs, engine, stack)}"))
    if stack is not None and vllm_server is not None:
        value = stack["output_tok_s"] / vllm_server["output_tok_s"]
        found.append(Target(f"tiny model: the stack at least {SERVER_FACTOR:g}x vLLM's server", value, SERVER_FACTOR,
                            f"{ratio(value)} ({num(stack['output_tok_s'], 0)} vs {num(vllm_server['output_tok_s'], 0)} tok/s"
                            f"{_ranges(stack, vllm_server)})"))
    return found


def _ranges(*rows: dict[str, Any]) -> str:
    """'; runs 4,861-5,652 vs 3,585-4,906' where the rows kept their runs' range of throughput."""
    spans = [row.get("output_tok_s_range") for row in rows]
    if not all(spans):
        return ""
    return "; runs " + " vs ".join(f"{num(low, 0)}-{num(high, 0)}" for low, high in spans)


def _ceiling(docs: Documents, engine: dict[str, Any], stack: dict[str, Any]) -> str:
    """The most the stack could keep on this machine's cores: with a decode worker no costlier than
    the engine alone, the other processes' and the client's CPU per token still share the cores."""
    cores = next((doc["machine"].get("cores") for doc in docs.values() if isinstance(doc.get("machine"), dict)), None)
    beside = {name.removeprefix("cpu_us_per_token."): us for name, us in stack.items()
              if name.startswith("cpu_us_per_token.") and not name.startswith("cpu_us_per_token.decode")}
    client = stack.get("client_cpu_us_per_token") or 0.0
    if not cores or not beside:
        return ""
    per_token = engine["cpu_us_per_token"] + sum(beside.values()) + client
    best = cores * 1e6 / per_token / engine["output_tok_s"]
    return (f"; at most {best:.0%} on these {cores} cores: the engine alone's {num(engine['cpu_us_per_token'], 0)} "
            f"CPU µs per token, plus the {num(sum(beside.values()), 0)} of the processes beside the decode worker "
            f"({', '.join(f'{name} {num(us, 0)}' for name, us in beside.items())}) and the client's {num(client, 0)}")


COMPARISON = Comparison(
    prefix="overhead",
    title="The serving stack's overhead",
    what="What the gateway, the streams and the workers add to the engine alone, on a tiny random-weight "
         "model whose compute is almost nothing: output tokens/s, and CPU time per output token by process.",
    body=body,
    targets=targets,
    summary=summary,
)
