"""What serving costs beyond the model (issue 47): a near-zero-cost model, so that the time left is
the serving path's, measured on this engine alone, this stack and, with --vllm, vLLM's engine and
server, with the same prompts and the same client.

    python -m bench.overhead [--layers 2 --hidden 64 ...] [--model PATH] [--vllm ENV/bin/python] \\
        [--num-prompts 256 --input-len 128 --output-len 128 --concurrency 16,64,256 --repeats 3]

The model is a random-weight Llama made at run time (bench/tiny_model.py; shape options as there),
or --model (a .gguf file or a Hugging Face folder). Every run is greedy with `ignore_eos`, in
--dtype. Rows: `shared.engine.llm.LLM.generate` in this process; `vllm.LLM.generate` in vLLM's
interpreter (bench/vllm_offline.py); this stack with its defaults (gateway, 1 prefill, 1 decode
worker, a private Redis) through bench.serving's client; vLLM's OpenAI server through the same
client. The servers take the prompts as one burst, then at each --concurrency cap below the number
of prompts.

A burst of 256 lasts a few seconds, and one run of it may differ from the next by a quarter on a
shared machine. So every row runs --repeats times on the same engine or server, in rounds (the
burst, then each cap), each run with fresh prompts of the same lengths: the tables show the run of
median throughput, with its CPU time and phases, and the range of the row's runs.

The main figure is CPU time (user + system, from /proc) per output token of every process: a shared
machine stretches wall-clock time, hardly CPU time. Where the processes keep phase counters (the
`*_phase_seconds_total` series of their /metrics, the engine's `phase_seconds`), a second table
says where the time goes, per output token and per engine step. Prints the tables, writes
bench/results/overhead.json and bench/results/overhead.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from bench import overhead_runs
from bench.overhead_runs import Run
from bench.phase_counters import phase_rows
from bench.servers import vllm_version
from bench.serving.workload import (
    FRESH_TOKENS_STREAM,
    BenchRequest,
    WorkloadSpec,
    build_workload,
    warmup_requests,
    with_fresh_tokens,
)
from bench.stack_harness import format_table, median_item, vocab_ids, write_figure, write_result
from bench.tiny_model import add_shape_options, shape_from, tiny_model
from shared.model.paths import ModelNotFoundError, resolve_model_path

NAME = "overhead"
NUM_WARMUPS = 2
ENGINE_OF = {"this stack": "this engine alone", "vLLM server": "vLLM engine alone"}
VLLM_OF = {"this engine alone": "vLLM engine alone", "this stack": "vLLM server"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_options(parser)
    parser.add_argument("--model", help="a .gguf file or Hugging Face folder instead of the tiny model")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", default="16,64,256", type=concurrency_caps,
                        help="the client's caps on requests in flight, comma-separated; a cap of at least "
                             "--num-prompts is the burst itself")
    parser.add_argument("--vllm", type=Path, metavar="PYTHON",
                        help="the Python of an environment with vLLM's CPU build: adds its engine and server")
    parser.add_argument("--vllm-kv-gib", type=float, default=1.0, help="--vllm: its KV cache (GiB)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each row; the tables show the run of median throughput")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def concurrency_caps(text: str) -> list[int]:
    caps = []
    for item in text.split(","):
        try:
            cap = int(item)
        except ValueError:
            cap = 0
        if cap < 1:
            raise argparse.ArgumentTypeError(f"concurrency caps are whole numbers >= 1, got {item!r} in {text!r}")
        caps.append(cap)
    return sorted(set(caps))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats is the runs of each row, at least 1, got {args.repeats}")
    try:
        spec = WorkloadSpec("random", args.num_prompts, input_len=args.input_len, output_len=args.output_len)
        model = str(resolve_model_path(args.model)) if args.model else str(tiny_model(shape_from(args)))
    except (ValueError, ModelNotFoundError) as error:
        parser.error(str(error))
    # before the long runs: a --vllm that cannot import vLLM fails now
    versions = {"vllm_version": vllm_version(args.vllm)} if args.vllm is not None else {}
    vocab = vocab_ids(model)
    requests = build_workload(spec, vocab, args.seed)
    warmups = warmup_requests(requests, vocab, args.seed, NUM_WARMUPS)
    loads = rounds(requests, vocab, args)
    bursts = [load for cap, load in loads if cap is None]

    runs = overhead_runs.this_engine(model, args.dtype, bursts, warmups)
    if args.vllm is not None:
        runs += overhead_runs.vllm_engine(args.vllm, model, args.dtype, args.vllm_kv_gib, bursts, warmups)
    runs += overhead_runs.this_stack(model, args.dtype, loads, warmups)
    if args.vllm is not None:
        runs += overhead_runs.vllm_serve(args.vllm, model, args.dtype, args.vllm_kv_gib, loads, warmups)

    burst_runs = {system: group for (system, cap), group in by_row(runs).items() if cap is None}
    table = main_table(burst_runs)
    sweep = sweep_table(runs, args.num_prompts)
    phases = [row for run in map(median_run, burst_runs.values()) for name, spent in run.phases.items()
              for row in phase_rows(f"{run.system}: {name}", spent, run.output_tokens)]  # fmt: skip
    print(render(table, sweep, phases))
    config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    document = {"config": {**config, "model": model, **versions}, "table": table, "sweep": sweep, "phases": phases,
                "runs": [run_document(run) for run in runs]}  # fmt: skip
    print(f"results: {write_result(NAME, document)}, {write_figure(NAME, sweep_figure(runs, args.num_prompts))}",
          file=sys.stderr)
    return 0 if all(run.failed == 0 for run in runs) else 1


def rounds(requests: list[BenchRequest], vocab: np.ndarray, args: argparse.Namespace) -> overhead_runs.Loads:
    """The served runs in order: --repeats rounds of the burst, then each cap below the number of
    prompts (a cap of at least every prompt would only repeat the burst). Every run but the first
    burst sends fresh tokens of the same lengths: the servers' prefix caches hold the runs before."""
    caps = [None] + [cap for cap in args.concurrency if cap < args.num_prompts]
    return [(cap, requests if cap is None and repeat == 0
             else with_fresh_tokens(requests, vocab, [args.seed, FRESH_TOKENS_STREAM, cap or 0, repeat]))
            for repeat in range(args.repeats) for cap in caps]  # fmt: skip


def by_row(runs: list[Run]) -> dict[tuple[str, int | None], list[Run]]:
    """The runs of each (system, cap), in the order they ran."""
    rows: dict[tuple[str, int | None], list[Run]] = {}
    for run in runs:
        rows.setdefault((run.system, run.concurrency), []).append(run)
    return rows


def median_run(runs: list[Run]) -> Run:
    """The run of median throughput (of an even count, the slower middle one): its CPU time and
    phases stay those of one run."""
    return median_item(runs, key=lambda run: run.tokens_per_s)


def main_table(bursts: dict[str, list[Run]]) -> list[dict[str, Any]]:
    """One row per system on the burst, from its run of median throughput: throughput, CPU per
    output token by process, and the ratios to vLLM's counterpart and to the system's own engine
    alone; and the range of its runs' throughputs."""
    medians = {system: median_run(group) for system, group in bursts.items()}
    rows = []
    for system, run in medians.items():
        cpu = run.cpu_us_per_token()
        total = sum(cpu.values())
        vllm, engine = medians.get(VLLM_OF.get(system, "")), medians.get(ENGINE_OF.get(system, ""))
        rows.append({
            "row": system,
            "output_tok_s": run.tokens_per_s,
            "output_tok_s_range": _range(bursts[system]),
            "share_of_own_engine": run.tokens_per_s / engine.tokens_per_s if engine else None,
            "vs_vllm": run.tokens_per_s / vllm.tokens_per_s if vllm else None,
            "cpu_us_per_token": total,
            "cpu_vs_vllm": total / sum(vllm.cpu_us_per_token().values()) if vllm else None,
            **{f"cpu_us_per_token.{name}": value for name, value in cpu.items()},
            "client_cpu_us_per_token": _per_token(run.client_cpu_s, run),
            "failed": run.failed,
        })  # fmt: skip
    return rows


def sweep_table(runs: list[Run], num_prompts: int) -> list[dict[str, Any]]:
    """One row per server and cap, from its run of median throughput, with the range of its runs."""
    served = {key: group for key, group in by_row(runs).items() if group[0].client_cpu_s is not None}
    rows = []
    for (system, cap), group in sorted(served.items(), key=lambda item: (item[0][0], item[0][1] or num_prompts)):
        run = median_run(group)
        rows.append({"row": system, "concurrency": cap or num_prompts, "output_tok_s": run.tokens_per_s,
                     "output_tok_s_range": _range(group), "cpu_us_per_token": sum(run.cpu_us_per_token().values()),
                     "client_cpu_us_per_token": _per_token(run.client_cpu_s, run),
                     "failed": sum(r.failed for r in group)})  # fmt: skip
    return rows


def render(table: list[dict[str, Any]], sweep: list[dict[str, Any]], phases: list[dict[str, Any]]) -> str:
    main = format_table(
        ["", "output tok/s", "runs' range", "of own engine", "vs vLLM", "CPU µs/token", "CPU vs vLLM",
         "CPU µs/token by process", "client CPU µs/token"],
        [[row["row"], f"{row['output_tok_s']:.0f}", _spread(row), _ratio(row["share_of_own_engine"]),
          _ratio(row["vs_vllm"]), f"{row['cpu_us_per_token']:.0f}", _ratio(row["cpu_vs_vllm"]), _by_process(row),
          _number(row["client_cpu_us_per_token"])] for row in table],
    )  # fmt: skip
    by_concurrency = format_table(
        ["server", "concurrency", "output tok/s", "runs' range", "CPU µs/token", "client CPU µs/token", "failed"],
        [[row["row"], str(row["concurrency"]), f"{row['output_tok_s']:.0f}", _spread(row),
          f"{row['cpu_us_per_token']:.0f}", _number(row["client_cpu_us_per_token"]), str(row["failed"])]
         for row in sweep],
    )  # fmt: skip
    by_phase = format_table(
        ["process", "phase", "µs/token", "ms/step", "share"],
        [[row["process"], row["phase"], _number(row["us_per_token"], ".1f"), _number(row["ms_per_step"], ".3f"),
          _ratio(row["share"], ".0%")] for row in phases],
    ) if phases else "no phase counters"  # fmt: skip
    return f"{main}\n\nBy concurrency cap:\n\n{by_concurrency}\n\nBy phase (burst):\n\n{by_phase}"


def sweep_figure(runs: list[Run], num_prompts: int) -> Figure:
    fig = Figure(figsize=(10, 4), layout="constrained")
    throughput, cpu = fig.subplots(1, 2)
    rows = sweep_table(runs, num_prompts)
    for system in dict.fromkeys(row["row"] for row in rows):
        points = [row for row in rows if row["row"] == system]
        caps = [row["concurrency"] for row in points]
        line = throughput.plot(caps, [row["output_tok_s"] for row in points], marker="o", label=system)[0]
        throughput.fill_between(caps, *zip(*(row["output_tok_s_range"] for row in points), strict=True),
                                color=line.get_color(), alpha=0.2, linewidth=0)
        cpu.plot(caps, [row["cpu_us_per_token"] for row in points], marker="o", label=system)
    caps = sorted({row["concurrency"] for row in rows})
    throughput.set(title="Output throughput (median run; band: the runs' range)", ylabel="output tokens/s")
    cpu.set(title="Servers' CPU per output token", ylabel="CPU µs/token")
    for ax in (throughput, cpu):
        # the caps double or quadruple: a log axis labelled with the caps themselves
        ax.set_xscale("log", base=2)
        ax.set_xticks(caps, [str(cap) for cap in caps])
        ax.minorticks_off()
        ax.set(xlabel="requests in flight (cap)", ylim=(0, None))
    throughput.legend()
    return fig


def run_document(run: Run) -> dict[str, Any]:
    return {"system": run.system, "concurrency": run.concurrency, "seconds": run.seconds,
            "output_tokens": run.output_tokens, "failed": run.failed, "cpu_s": run.cpu_s,
            "client_cpu_s": run.client_cpu_s,
            "phases": {name: {"seconds": spent.seconds, "steps": spent.steps} for name, spent in run.phases.items()}}


def _range(runs: list[Run]) -> list[float]:
    return [min(run.tokens_per_s for run in runs), max(run.tokens_per_s for run in runs)]


def _spread(row: dict[str, Any]) -> str:
    """The runs' range of throughput, "-" in results from before it was kept."""
    low, high = row.get("output_tok_s_range") or (None, None)
    return "-" if low is None else f"{low:.0f}-{high:.0f}"


def _per_token(seconds: float | None, run: Run) -> float | None:
    return None if seconds is None else seconds * 1e6 / max(run.output_tokens, 1)


def _by_process(row: dict[str, Any]) -> str:
    prefix = "cpu_us_per_token."
    return ", ".join(f"{key.removeprefix(prefix)} {value:.0f}" for key, value in row.items() if key.startswith(prefix))


def _ratio(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else f"{value:{spec}}" + ("" if spec.endswith("%") else "x")


def _number(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else f"{value:{spec}}"


if __name__ == "__main__":
    sys.exit(main())
