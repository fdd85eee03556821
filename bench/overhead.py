"""What serving costs beyond the model (issue 47): a near-zero-cost model, so that the time left is
the serving path's, measured on this engine alone, this stack and, with --vllm, vLLM's engine and
server, with the same prompts and the same client.

    python -m bench.overhead [--layers 2 --hidden 64 ...] [--model PATH] [--vllm ENV/bin/python] \\
        [--num-prompts 256 --input-len 128 --output-len 128 --concurrency 16,64,256]

The model is a random-weight Llama made at run time (bench/tiny_model.py; shape options as there),
or --model (a .gguf file or a Hugging Face folder). Every run is greedy with `ignore_eos`, in
--dtype. Rows: `shared.engine.llm.LLM.generate` in this process; `vllm.LLM.generate` in vLLM's
interpreter (bench/vllm_offline.py); this stack with its defaults (gateway, 1 prefill, 1 decode
worker, a private Redis) through bench.serving's client; vLLM's OpenAI server through the same
client. The servers take the prompts as one burst, then at each --concurrency cap below the number
of prompts.

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

from matplotlib.figure import Figure

from bench import overhead_runs
from bench.overhead_runs import Run
from bench.phase_counters import phase_rows
from bench.servers import vllm_version
from bench.serving.workload import BenchRequest, WorkloadSpec, build_workload, warmup_requests, with_fresh_tokens
from bench.stack_harness import format_table, vocab_ids, write_figure, write_result
from bench.tiny_model import add_shape_options, shape_from, tiny_model
from shared.model.paths import ModelNotFoundError, resolve_model_path

NAME = "overhead"
NUM_WARMUPS = 2
FRESH_TOKENS_STREAM = 3  # the workload's random streams 0-2 are its prompts, arrivals and warm-ups
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
    # the burst first; a cap of at least every prompt would only repeat it. Each cap sends fresh tokens
    # of the same lengths: the servers' prefix caches hold the prompts of the runs before
    loads: dict[int | None, list[BenchRequest]] = {None: requests} | {
        cap: with_fresh_tokens(requests, vocab, [args.seed, FRESH_TOKENS_STREAM, cap])
        for cap in args.concurrency if cap < args.num_prompts
    }

    runs = [overhead_runs.this_engine(model, args.dtype, requests, warmups)]
    if args.vllm is not None:
        runs.append(overhead_runs.vllm_engine(args.vllm, model, args.dtype, args.vllm_kv_gib, requests, warmups))
    runs += overhead_runs.this_stack(model, args.dtype, loads, warmups)
    if args.vllm is not None:
        runs += overhead_runs.vllm_serve(args.vllm, model, args.dtype, args.vllm_kv_gib, loads, warmups)

    bursts = {run.system: run for run in runs if run.concurrency is None}
    table = main_table(bursts)
    sweep = sweep_table(runs, args.num_prompts)
    phases = [row for run in bursts.values() for name, spent in run.phases.items()
              for row in phase_rows(f"{run.system}: {name}", spent, run.output_tokens)]  # fmt: skip
    print(render(table, sweep, phases))
    config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    document = {"config": {**config, "model": model, **versions}, "table": table, "sweep": sweep, "phases": phases,
                "runs": [run_document(run) for run in runs]}  # fmt: skip
    print(f"results: {write_result(NAME, document)}, {write_figure(NAME, sweep_figure(runs, args.num_prompts))}",
          file=sys.stderr)
    return 0 if all(run.failed == 0 for run in runs) else 1


def main_table(bursts: dict[str, Run]) -> list[dict[str, Any]]:
    """One row per system on the burst: throughput, CPU per output token by process, and the
    ratios to vLLM's counterpart and to the system's own engine alone."""
    rows = []
    for system, run in bursts.items():
        cpu = run.cpu_us_per_token()
        total = sum(cpu.values())
        vllm, engine = bursts.get(VLLM_OF.get(system, "")), bursts.get(ENGINE_OF.get(system, ""))
        rows.append({
            "row": system,
            "output_tok_s": run.tokens_per_s,
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
    return [{"row": run.system, "concurrency": run.concurrency or num_prompts, "output_tok_s": run.tokens_per_s,
             "cpu_us_per_token": sum(run.cpu_us_per_token().values()),
             "client_cpu_us_per_token": _per_token(run.client_cpu_s, run), "failed": run.failed}
            for run in sorted(runs, key=lambda run: (run.system, run.concurrency or num_prompts))
            if run.client_cpu_s is not None]  # fmt: skip


def render(table: list[dict[str, Any]], sweep: list[dict[str, Any]], phases: list[dict[str, Any]]) -> str:
    main = format_table(
        ["", "output tok/s", "of own engine", "vs vLLM", "CPU µs/token", "CPU vs vLLM", "CPU µs/token by process",
         "client CPU µs/token"],
        [[row["row"], f"{row['output_tok_s']:.0f}", _ratio(row["share_of_own_engine"]), _ratio(row["vs_vllm"]),
          f"{row['cpu_us_per_token']:.0f}", _ratio(row["cpu_vs_vllm"]), _by_process(row),
          _number(row["client_cpu_us_per_token"])] for row in table],
    )  # fmt: skip
    by_concurrency = format_table(
        ["server", "concurrency", "output tok/s", "CPU µs/token", "client CPU µs/token", "failed"],
        [[row["row"], str(row["concurrency"]), f"{row['output_tok_s']:.0f}", f"{row['cpu_us_per_token']:.0f}",
          _number(row["client_cpu_us_per_token"]), str(row["failed"])] for row in sweep],
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
    served = [run for run in runs if run.client_cpu_s is not None]
    for system in dict.fromkeys(run.system for run in served):
        points = sorted((run.concurrency or num_prompts, run) for run in served if run.system == system)
        caps = [cap for cap, _ in points]
        throughput.plot(caps, [run.tokens_per_s for _, run in points], marker="o", label=system)
        cpu.plot(caps, [sum(run.cpu_us_per_token().values()) for _, run in points], marker="o", label=system)
    caps = sorted({run.concurrency or num_prompts for run in served})
    throughput.set(title="Output throughput", ylabel="output tokens/s")
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
