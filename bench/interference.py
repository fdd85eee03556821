"""Decode inter-token latency while a burst of long prompts arrives: disaggregated (a prefill and a
decode worker, each pinned to its own cores) against colocated (one worker on all of those cores,
prefilling the long prompts in chunks in the same steps as the decodes, as vLLM and SGLang do
without disaggregation).

    python -m bench.interference --num-short 100 --rate 0.5 --num-long 8 --long-input-len 2048

Each mode gets a fresh stack and the same seeded workload: a steady Poisson stream of short
requests and, in the middle of it, a burst of long prompts sent at once. The short requests'
inter-token gaps are split by whether they overlap the burst window (the burst's first send to
its last completion): ITL p50/p99 without and during the burst, and their ratio, per mode, over all
gaps and over the gaps after each request's first (which, disaggregated, spans the KV handoff), and
the long prompts' TTFT. Prints a table, writes bench/results/<name>.json and <name>.png (ITL over
time, the burst window shaded); progress goes to stderr. The gateway, Redis and this client are
not pinned: on a small machine they share the workers' cores, so run it on an otherwise idle one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import numpy as np
from matplotlib.figure import Figure

from bench.serving.arrivals import arrival_offsets
from bench.serving.client import RequestResult, Target, fetch_model_name
from bench.serving.metrics import summarize
from bench.serving.runner import LoadSpec, RunOutcome, WarmupError, run_benchmark
from bench.serving.workload import (
    BenchRequest,
    WorkloadSpec,
    build_workload,
    warmup_requests,
)
from bench.stack_harness import (
    REQUEST_TIMEOUT_S,
    SCRAPE_TIMEOUT_S,
    format_table,
    stack_config,
    vocab_ids,
    write_figure,
    write_result,
)
from services.launcher import Stack, StackConfig
from services.launcher.redis_server import StackError
from shared.settings import parse_cpu_list

MODES = ("disaggregated", "colocated")
ITL_PERCENTILES = [50.0, 99.0]
TTFT_PERCENTILES = [50.0, 100.0]  # p100: the slowest long prompt
TARGET_RATIO = 1.5  # disaggregated ITL p99 during the burst vs without it


@dataclass(slots=True, frozen=True)
class Workload:
    short: list[BenchRequest]
    long: list[BenchRequest]
    warmups: list[BenchRequest]
    burst_at_s: float  # when the burst is sent, after the steady stream's start


@dataclass(slots=True)
class Timeline:
    """One mode's requests, their times in seconds on the steady stream's clock."""

    short: list[RequestResult]
    long: list[RequestResult]
    burst_offset_s: float  # where the burst's own clock starts on the steady stream's


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.interference", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    available = sorted(os.sched_getaffinity(0))
    stack = parser.add_argument_group("stacks")
    stack.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    stack.add_argument("--model", default="default")
    stack.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    stack.add_argument("--prefill-cpus", default=str(available[0]),
                       help="disaggregated: the prefill worker's CPUs (one torch thread each)")
    stack.add_argument("--decode-cpus", default=str(available[-1]),
                       help="disaggregated: the decode worker's CPUs; colocated: one worker on both sets")
    stack.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="token budget of an engine step: how much of a long prompt a colocated step takes")
    stack.add_argument("--kv-memory-mib", type=int, default=1024, help="KV pool of each worker")
    stack.add_argument("--kv-transport", default="auto", choices=("auto", "shm", "nixl", "tcp", "redis"),
                       help="LLMD_WORKER__KV_TRANSPORT of the disaggregated stack: tcp takes the data port, as "
                       "between hosts (long prompts' KV then streams layer by layer while they prefill)")

    load = parser.add_argument_group("workload")
    load.add_argument("--num-short", type=int, default=100, help="requests of the steady stream")
    load.add_argument("--rate", type=float, default=0.5, help="short requests per second (Poisson)")
    load.add_argument("--short-input-len", type=int, default=64)
    load.add_argument("--short-min-tokens", type=int, default=64, help="output tokens, drawn uniformly from min..max")
    load.add_argument("--short-max-tokens", type=int, default=128)
    load.add_argument("--num-long", type=int, default=8, help="long prompts in the burst, sent at once")
    load.add_argument("--long-input-len", type=int, default=2048)
    load.add_argument("--long-output-len", type=int, default=4,
                      help="1: the prefill worker finishes the request itself (no KV handoff)")
    load.add_argument("--burst-at", type=float, help="seconds after the stream starts (default: its middle)")
    load.add_argument("--num-warmups", type=int, default=1, help="untimed requests of each kind sent first")
    load.add_argument("--seed", type=int, default=0)

    report = parser.add_argument_group("report")
    report.add_argument("--name", default="interference", help="bench/results/<name>.json and .png")
    report.add_argument("--progress-interval", type=float, default=5.0, help="seconds; 0 turns progress off")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the first invalid option."""
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        raise ValueError(f"--modes {args.modes!r}: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    prefill, decode = parse_cpu_list(args.prefill_cpus), parse_cpu_list(args.decode_cpus)
    if not prefill or not decode or prefill & decode:
        raise ValueError(f"--prefill-cpus {args.prefill_cpus!r} and --decode-cpus {args.decode_cpus!r} must be "
                         "non-empty and disjoint")
    if not 1 <= args.short_min_tokens <= args.short_max_tokens:
        raise ValueError(f"--short-min-tokens {args.short_min_tokens} must be in 1..--short-max-tokens "
                         f"({args.short_max_tokens})")
    if min(args.num_short, args.num_long, args.short_input_len, args.long_input_len, args.long_output_len) < 1:
        raise ValueError("--num-short, --num-long, --short-input-len, --long-input-len and --long-output-len "
                         "must be at least 1")
    if args.rate <= 0 or math.isinf(args.rate):
        raise ValueError(f"--rate {args.rate} must be a finite number of requests per second above 0")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups {args.num_warmups} must be at least 0")


def make_workload(args: argparse.Namespace) -> Workload:
    vocab = vocab_ids(args.model)
    spec = WorkloadSpec("random", args.num_short, input_len=args.short_input_len, output_len=args.short_min_tokens)
    short = build_workload(spec, vocab, args.seed)
    num_tokens = np.random.default_rng([args.seed, 3]).integers(
        args.short_min_tokens, args.short_max_tokens + 1, size=args.num_short
    )
    short = [dataclasses.replace(req, max_tokens=int(n)) for req, n in zip(short, num_tokens, strict=True)]
    # another seed: the long prompts must not start with a short one's tokens (a prefix-cache hit)
    spec = WorkloadSpec("random", args.num_long, input_len=args.long_input_len, output_len=args.long_output_len)
    long = build_workload(spec, vocab, args.seed + 1)
    warmups = [
        *warmup_requests(short, vocab, args.seed, args.num_warmups),
        *warmup_requests(long, vocab, args.seed, args.num_warmups),
    ]
    burst_at_s = args.burst_at
    if burst_at_s is None:
        burst_at_s = arrival_offsets(args.num_short, args.rate, args.seed)[-1] / 2
    return Workload(short, long, warmups, burst_at_s)


def pinned(cpus: str) -> dict[str, str]:
    """A worker that owns `cpus`: one thread on each, all the time (no sizing to the free cores,
    which would count the unpinned gateway, Redis and client against it)."""
    return {"LLMD_WORKER__CPUS": cpus, "LLMD_TORCH_THREADS": str(len(parse_cpu_list(cpus))),
            "LLMD_WORKER__ELASTIC_THREADS": "false"}  # fmt: skip


def mode_config(mode: str, args: argparse.Namespace) -> StackConfig:
    env = {
        "LLMD_KV_CACHE__MEMORY_BYTES": str(args.kv_memory_mib * 2**20),
        "LLMD_SCHEDULER__MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
        # torch's OpenMP threads sleep at barriers instead of spinning: a worker with several threads
        # whose cores the gateway, Redis and this client also use is otherwise up to 10x slower
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    if mode == "disaggregated":
        config = stack_config(env | {"LLMD_WORKER__KV_TRANSPORT": args.kv_transport})
        role_env = {"prefill": pinned(args.prefill_cpus), "decode": pinned(args.decode_cpus)}
    else:
        config = dataclasses.replace(stack_config(env, num_prefill=0, num_decode=0), num_colocated=1)
        role_env = {"colocated": pinned(f"{args.prefill_cpus},{args.decode_cpus}")}
    return dataclasses.replace(config, model=args.model, dtype=args.dtype, role_env=role_env)


# -- measuring -------------------------------------------------------------------------------------


async def clocked(run: Coroutine[Any, Any, RunOutcome]) -> tuple[float, RunOutcome]:
    """The outcome of a `run_benchmark` call, and the perf_counter reading its clock starts from:
    it starts the clock before it first yields to the event loop, so this reading is microseconds off."""
    start = time.perf_counter()
    return start, await run


async def measure(base_url: str, workload: Workload, args: argparse.Namespace, mode: str) -> Timeline:
    async with aiohttp.ClientSession() as session:
        model = await fetch_model_name(session, base_url, SCRAPE_TIMEOUT_S)
    target = Target(url=f"{base_url}/v1/completions", model=model, timeout_s=REQUEST_TIMEOUT_S)
    print(f"[{mode}] {len(workload.warmups)} warm-up requests", file=sys.stderr, flush=True)
    await run_benchmark(target, [], LoadSpec(progress_interval_s=0), workload.warmups)

    async def burst(at: float) -> tuple[float, RunOutcome]:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        print(f"[{mode}] burst: {len(workload.long)} prompts of {workload.long[0].num_prompt_tokens} tokens",
              file=sys.stderr, flush=True)
        start, outcome = await clocked(run_benchmark(target, workload.long, LoadSpec(progress_interval_s=0)))
        print(f"[{mode}] burst done in {outcome.duration_s:.1f}s", file=sys.stderr, flush=True)
        return start, outcome

    steady_load = LoadSpec(request_rate=args.rate, seed=args.seed, progress_interval_s=args.progress_interval)
    print(f"[{mode}] {len(workload.short)} short requests at {args.rate:g}/s; the burst at "
          f"{workload.burst_at_s:.1f}s", file=sys.stderr, flush=True)
    (steady_start, steady), (burst_start, bursted) = await asyncio.gather(
        clocked(run_benchmark(target, workload.short, steady_load)),
        burst(time.perf_counter() + workload.burst_at_s),
    )
    return Timeline(steady.results, bursted.results, burst_start - steady_start)


# -- analysis --------------------------------------------------------------------------------------


def distribution(values_s: list[float], percentiles: list[float]) -> dict[str, Any] | None:
    summary = summarize(values_s, percentiles)
    return None if summary is None else {"count": len(values_s), **dataclasses.asdict(summary)}


def ratio(during: dict[str, Any] | None, without: dict[str, Any] | None, key: str) -> float | None:
    if during is None or without is None or without["percentiles"][key] <= 0:
        return None
    return float(during["percentiles"][key] / without["percentiles"][key])


def itl_around(gaps: list[tuple[float, float]], window: tuple[float, float]) -> dict[str, Any]:
    """ITL of the gaps (start, end) that miss the burst window and of those that overlap it."""
    during = [b - a for a, b in gaps if a < window[1] and b > window[0]]
    without = [b - a for a, b in gaps if not (a < window[1] and b > window[0])]
    itl_without, itl_during = distribution(without, ITL_PERCENTILES), distribution(during, ITL_PERCENTILES)
    return {
        "no_burst": itl_without,
        "during_burst": itl_during,
        "ratio": {"p50": ratio(itl_during, itl_without, "p50"), "p99": ratio(itl_during, itl_without, "p99")},
    }


def analyse(timeline: Timeline) -> dict[str, Any]:
    """The figures of one mode; times in seconds on the steady stream's clock, latencies in ms."""
    offset = timeline.burst_offset_s
    window = (
        offset + min(r.start_s for r in timeline.long),
        offset + max(r.start_s + (r.latency_s or 0.0) for r in timeline.long),
    )
    done = [r for r in timeline.short if r.success]
    # (start, end, whether it is the request's first gap), on the steady stream's clock
    gaps = [
        (r.start_s + a, r.start_s + b, i == 0)
        for r in done for i, (a, b) in enumerate(itertools.pairwise(r.chunk_times_s))
    ]  # fmt: skip
    span_s = max((r.start_s + (r.latency_s or 0.0) for r in done), default=0.0) - min(
        (r.start_s for r in done), default=0.0
    )
    long_done = [r for r in timeline.long if r.success]
    return {
        "burst_window_s": list(window),
        "short": {
            "num_completed": len(done),
            "num_failed": len(timeline.short) - len(done),
            "mean_in_flight": sum(r.latency_s or 0.0 for r in done) / span_s if span_s > 0 else None,
            "itl_ms": itl_around([(a, b) for a, b, _ in gaps], window),
            # in disaggregated mode the first gap spans the KV handoff, which waits for the prefill
            # worker's engine (busy with a long prompt during the burst); the later ones are decode steps only
            "itl_after_first_gap_ms": itl_around([(a, b) for a, b, first in gaps if not first], window),
        },
        "long": {
            "num_completed": len(long_done),
            "num_failed": len(timeline.long) - len(long_done),
            "ttft_ms": distribution([r.ttft_s for r in long_done if r.ttft_s is not None], TTFT_PERCENTILES),
        },
        "failures": dict(Counter(r.error for r in [*timeline.short, *timeline.long] if r.error).most_common()),
        # (end of the gap, ITL, whether it is the request's first gap) of every short request's gap
        "gaps": [[round(b, 4), round((b - a) * 1000, 3), first] for a, b, first in gaps],
    }


# -- report ----------------------------------------------------------------------------------------


def _ms(dist: dict[str, Any] | None, key: str) -> str:
    return "-" if dist is None else f"{dist['percentiles'][key]:.0f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


GAP_SETS = (("itl_ms", "all gaps"), ("itl_after_first_gap_ms", "after the 1st gap"))


def format_report(results: dict[str, dict[str, Any]]) -> str:
    header = ["mode", "short ITL", "p50 no burst / burst (ms)", "p99 no burst / burst (ms)", "p99 ratio",
              "short done/failed, in flight", "long TTFT p50 / max (ms)"]
    rows = []
    for mode, result in results.items():
        short, ttft = result["short"], result["long"]["ttft_ms"]
        in_flight = "-" if short["mean_in_flight"] is None else f"{short['mean_in_flight']:.1f}"
        for key, label in GAP_SETS:
            itl = short[key]
            rows.append([
                mode, label,
                f"{_ms(itl['no_burst'], 'p50')} / {_ms(itl['during_burst'], 'p50')}",
                f"{_ms(itl['no_burst'], 'p99')} / {_ms(itl['during_burst'], 'p99')}",
                _times(itl["ratio"]["p99"]), f"{short['num_completed']}/{short['num_failed']}, {in_flight}",
                f"{_ms(ttft, 'p50')} / {_ms(ttft, 'p100')}",
            ])  # fmt: skip
    lines = [format_table(header, rows)]
    for key, label in GAP_SETS:
        ratios = ", ".join(f"{mode} {_times(r['short'][key]['ratio']['p99'])}" for mode, r in results.items())
        lines.append(f"short ITL p99 during the burst / without it ({label}): {ratios} (target for disaggregated: "
                     f"<= {TARGET_RATIO}x)")
    return "\n".join(lines)


def figure(results: dict[str, dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(10, 3.2 * len(results)), layout="constrained")
    axes = fig.subplots(len(results), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (mode, result) in zip(axes, results.items(), strict=True):
        gaps = np.asarray(result["gaps"], dtype=np.float64).reshape(-1, 3)
        first = gaps[:, 2] > 0
        ax.scatter(gaps[~first, 0], gaps[~first, 1], s=3, alpha=0.5, color="tab:blue", label="short requests' ITL")
        ax.scatter(gaps[first, 0], gaps[first, 1], s=8, marker="x", color="tab:orange",
                   label="their first gap (spans the handoff when disaggregated)")
        ax.axvspan(*result["burst_window_s"], color="tab:red", alpha=0.15, label="burst of long prompts")
        ax.set(title=mode, ylabel="ITL (ms)", yscale="log")
    axes[0].legend(loc="lower left", bbox_to_anchor=(0, 1.1), ncols=3, fontsize="small", frameon=False)
    axes[-1].set_xlabel("time since the steady stream started (s)")
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))
    workload = make_workload(args)
    results: dict[str, dict[str, Any]] = {}
    try:
        for mode in args.modes.split(","):
            print(f"[{mode}] starting the stack", file=sys.stderr, flush=True)
            with Stack(mode_config(mode, args)) as stack:
                assert stack.base_url is not None, "the harness's stacks have a gateway"
                timeline = asyncio.run(measure(stack.base_url, workload, args, mode))
            results[mode] = analyse(timeline)
    except (StackError, WarmupError, aiohttp.ClientError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(results))
    config = {**vars(args), "burst_at": workload.burst_at_s, "date": datetime.now(UTC).isoformat(timespec="seconds")}
    print(f"results: {write_result(args.name, {'config': config, 'modes': results})}", file=sys.stderr)
    print(f"figure: {write_figure(args.name, figure(results))}", file=sys.stderr)
    return 0 if all(r["short"]["num_completed"] > 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
