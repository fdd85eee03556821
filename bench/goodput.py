"""Goodput under latency targets (DistServe's measure): Poisson arrivals at a sweep of rates on a
chat-like mix, against this stack disaggregated, this stack colocated and, with --vllm, vLLM's CPU
build, one server after the other.

    python -m bench.goodput [--rates 0.25,0.5,1,1.5,2] [--duration-s 60] [--vllm PYTHON]
        [--ttft-scale 5 --itl-scale 5 | --ttft-ms MS --itl-ms MS] [--itl-measure p90|mean]

The targets scale with what the machine can do: before the sweep, this stack (disaggregated)
answers a few median-length prompts one at a time, and the targets are `--ttft-scale` times their
median time to first token and `--itl-scale` times their median gap between tokens, the same
absolute targets for every server. On a GPU give them in ms instead. This stack's servers are
given the targets (LLMD_TARGETS__*): its decode worker paces itself to the inter-token one while
prompts are prefilled on its cores.
Every rate sends the lengths of the first requests of one sample at one draw of arrival gaps
scaled to the rate, so the rates differ in load alone; each rate's prompts are new tokens, so no
rate finds the prompts of the one before in the prefix cache. Per rate it prints the share of
requests meeting the TTFT target, the inter-token target (each request's p90 gap by default;
bench/serving/attainment.py) and both, and for the disaggregated stack the steps its decode worker
paced and how many of them still came late (llmd_paced_steps, docs/deploy.md); the goodput is the
highest rate up to which at least --share (90%) meet both. Writes bench/results/<name>.json and a
plot of attainment against rate, bench/results/<name>.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from bench.serving.attainment import DEFAULT_SHARE, ITL_MEASURES, Attainment, LatencyTargets, attainment, goodput
from bench.serving.runner import LoadSpec
from bench.serving.workload import BenchRequest, WorkloadSpec, build_workload, warmup_requests, with_fresh_tokens
from bench.servers import vllm_server, vllm_version
from bench.stack_harness import (
    format_table, metric_sum, run_load, scrape_workers, stack_config, vocab_ids, write_figure, write_result,
)
from services.launcher import Stack

SERVERS = ("disaggregated", "colocated")
CALIBRATION_OUTPUT_TOKENS = 32
WARMUP_CONCURRENCY = 8
RATE_STREAM = 3  # the random streams of each rate's prompts: [sample seed, RATE_STREAM, rate's index]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"this stack's modes to run, comma-separated, from {', '.join(SERVERS)}")
    parser.add_argument("--vllm", type=Path, metavar="PYTHON", help="also vLLM's CPU build from this environment")
    parser.add_argument("--vllm-kv-gib", type=float, default=4.0, help="--vllm: its KV cache (GiB)")
    parser.add_argument("--rates", default="0.25,0.5,1,1.5,2", help="request rates to sweep (req/s), ascending")
    parser.add_argument("--duration-s", type=float, default=60.0,
                        help="arrivals at each rate span about this long (rate x duration requests)")
    parser.add_argument("--min-requests", type=int, default=16, help="at least this many requests per rate")
    parser.add_argument("--input-len", type=int, default=256, help="median prompt tokens (lognormal)")
    parser.add_argument("--output-len", type=int, default=96, help="median output tokens (lognormal)")
    parser.add_argument("--length-sigma", type=float, default=0.8, help="lognormal sigma of both lengths")
    parser.add_argument("--ttft-scale", type=float, default=5.0, help="TTFT target over the unloaded TTFT")
    parser.add_argument("--itl-scale", type=float, default=5.0, help="inter-token target over the unloaded step")
    parser.add_argument("--ttft-ms", type=float, help="absolute TTFT target (with --itl-ms: no calibration)")
    parser.add_argument("--itl-ms", type=float, help="absolute inter-token target")
    parser.add_argument("--itl-measure", default="p90", choices=ITL_MEASURES,
                        help="a request's inter-token latency: the p90 of its gaps, or their mean (TPOT)")
    parser.add_argument("--share", type=float, default=DEFAULT_SHARE, help="share of requests that must meet both")
    parser.add_argument("--stop-below", type=float, default=0.5,
                        help="stop a server's sweep after a rate where fewer than this share met both")
    parser.add_argument("--pauses", action="store_true",
                        help="this stack spends the late gaps that the p90 measure allows on a long prompt: its decode "
                        "worker pauses its streams for one beside it, its colocated engine lets one take a whole step "
                        "(LLMD_TARGETS__ITL_PERCENTILE=90)")
    parser.add_argument("--calibration-requests", type=int, default=3)
    parser.add_argument("--warmup-requests", type=int, default=32,
                        help="untimed requests of the mix's shapes each server answers, 8 at a time, before its sweep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="goodput", help="results file name")
    return parser


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates) or rates != sorted(rates):
        raise ValueError(f"--rates {text!r} must be positive request rates in ascending order")
    return rates


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    servers = [s for s in args.servers.split(",") if s]
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown:
        parser.error(f"--servers: unknown {unknown}; choose from {', '.join(SERVERS)}")
    if not servers and args.vllm is None:
        parser.error("nothing to measure: give --servers or --vllm")
    if (args.ttft_ms is None) != (args.itl_ms is None):
        parser.error("--ttft-ms and --itl-ms go together (or neither, to calibrate)")
    if not 0 < args.share <= 1:
        parser.error(f"--share must be in (0, 1], got {args.share}")
    if args.pauses and args.itl_measure != "p90":
        parser.error(f"--pauses spends the late gaps that the p90 measure allows: not with --itl-measure {args.itl_measure}")
    try:
        parse_rates(args.rates)
    except ValueError as e:
        parser.error(str(e))
    return servers


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    servers = check_args(args, parser)
    vocab = vocab_ids(args.model)
    calibration: dict[str, float] = {}
    if args.ttft_ms is None:
        with _stack("disaggregated", {}) as (base_url, _):
            _warm_up(base_url, args, vocab)
            calibration = calibrate(base_url, args, vocab)
        targets = LatencyTargets(args.ttft_scale * calibration["ttft_ms"], args.itl_scale * calibration["itl_ms"],
                                 args.itl_measure)
        print(f"unloaded: TTFT {calibration['ttft_ms']:.0f} ms, step {calibration['itl_ms']:.0f} ms -> targets TTFT "
              f"{targets.ttft_ms:.0f} ms, inter-token ({targets.itl_measure}) {targets.itl_ms:.0f} ms", file=sys.stderr)
    else:
        targets = LatencyTargets(args.ttft_ms, args.itl_ms, args.itl_measure)

    percentile = 90 if args.pauses else 100
    env = {"LLMD_TARGETS__TTFT_MS": f"{targets.ttft_ms:g}", "LLMD_TARGETS__ITL_MS": f"{targets.itl_ms:g}",
           "LLMD_TARGETS__ITL_PERCENTILE": str(percentile)}
    starters: dict[str, Callable[[], AbstractContextManager[Server]]] = {
        mode: functools.partial(_stack, mode, env) for mode in servers}
    if args.vllm is not None:
        starters[f"vLLM CPU {vllm_version(args.vllm)}"] = lambda: _vllm(args)
    runs: dict[str, list[Attainment]] = {}
    pacing: dict[str, list[dict[str, float]]] = {}
    for label, start in starters.items():
        with start() as (base_url, paced_steps):
            _warm_up(base_url, args, vocab)
            runs[label], pacing[label] = sweep(label, base_url, args, vocab, targets, paced_steps)

    print(report_table(runs, targets, args.share))
    document = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "calibration": calibration,
        "targets": dataclasses.asdict(targets),
        "runs": {label: [dataclasses.asdict(p) for p in points] for label, points in runs.items()},
        "goodput": {label: goodput(points, args.share) for label, points in runs.items()},
        "pacing": {label: points for label, points in pacing.items() if points},
    }
    print(f"results: {write_result(args.name, document)}, {write_figure(args.name, figure(runs, args.share))}",
          file=sys.stderr)
    return 0


# a server's base URL, and where its decode workers pace their steps, how to read their running
# totals of planned steps and late ones (services/pacing.py)
Server = tuple[str, Callable[[], tuple[float, float]] | None]


@contextmanager
def _stack(mode: str, env: dict[str, str]) -> Iterator[Server]:
    config = stack_config(env) if mode == "disaggregated" else dataclasses.replace(
        stack_config(env, num_prefill=0, num_decode=0), num_colocated=1)
    with Stack(config) as stack:
        assert stack.base_url is not None
        # a colocated worker has no neighbour on the lease to lend its cores to, so it never paces
        yield stack.base_url, functools.partial(_paced_steps, stack) if mode == "disaggregated" else None


def _paced_steps(stack: Stack) -> tuple[float, float]:
    samples = scrape_workers(stack, "decode")
    return metric_sum(samples, "llmd_paced_steps_total"), metric_sum(samples, "llmd_paced_steps_late_total")


@contextmanager
def _vllm(args: argparse.Namespace) -> Iterator[Server]:
    with vllm_server(args.vllm, args.model, args.vllm_kv_gib) as server:
        yield server.base_url, None


def _warm_up(base_url: str, args: argparse.Namespace, vocab: Any) -> None:
    """Batches and chunks of the sizes the sweep will run, before it: a server's first steps of a
    new size build their kernels (oneDNN's, vLLM's), and a sweep that started at 4 req/s cold
    met both targets for 11-64% of its requests there and 79-99% one rate higher (machine L)."""
    num = args.warmup_requests
    warm = warmup_requests(_workload(args, vocab, num, args.seed), vocab, args.seed, num)
    run_load(base_url, warm, LoadSpec(max_concurrency=WARMUP_CONCURRENCY, progress_interval_s=0))


def _workload(args: argparse.Namespace, vocab: Any, num_prompts: int, seed: int) -> list[BenchRequest]:
    spec = WorkloadSpec("chat-mix", num_prompts, input_len=args.input_len, output_len=args.output_len,
                        length_sigma=args.length_sigma)
    return build_workload(spec, vocab, seed)


def calibrate(base_url: str, args: argparse.Namespace, vocab: Any) -> dict[str, float]:
    """Median TTFT of median-length prompts sent one at a time, and their median gap between tokens."""
    spec = WorkloadSpec("random", args.calibration_requests, input_len=args.input_len,
                        output_len=CALIBRATION_OUTPUT_TOKENS)
    _, results = run_load(base_url, build_workload(spec, vocab, args.seed + 1),
                          LoadSpec(max_concurrency=1, progress_interval_s=0))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"calibration requests failed: {failed}")
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    gaps = [gap for r in results for gap in r.itl_s]
    return {"ttft_ms": 1000 * statistics.median(ttfts), "itl_ms": 1000 * statistics.median(gaps)}


def sweep(
    label: str, base_url: str, args: argparse.Namespace, vocab: Any, targets: LatencyTargets,
    paced_steps: Callable[[], tuple[float, float]] | None = None,
) -> tuple[list[Attainment], list[dict[str, float]]]:
    """Each rate's attainment and, given `paced_steps`, the steps the decode workers planned at it
    and how many of those still came late."""
    # Common random numbers: every rate sends the shapes of the first requests of one sample, at
    # one draw of arrival gaps scaled to the rate, so rates differ in load alone and one unlucky
    # burst in one rate's sample does not decide the goodput on its own. Each rate's prompts are
    # new tokens: the same prompts again would be prefix-cache hits, prefilled for free.
    rates = parse_rates(args.rates)
    counts = [max(args.min_requests, round(rate * args.duration_s)) for rate in rates]
    sample_seed = args.seed + 100
    sample = _workload(args, vocab, max(counts), sample_seed)
    points, pacing = [], []
    for i, (rate, num) in enumerate(zip(rates, counts, strict=True)):
        print(f"{label}: {num} requests at {rate:g} req/s", file=sys.stderr)
        requests = with_fresh_tokens(sample[:num], vocab, [sample_seed, RATE_STREAM, i])
        before = paced_steps() if paced_steps is not None else None
        _, results = run_load(base_url, requests, LoadSpec(request_rate=rate, seed=args.seed))
        point = attainment(rate, results, targets)
        points.append(point)
        print(f"{label} at {rate:g} req/s: TTFT {point.ttft:.0%}, inter-token {point.itl:.0%}, both {point.both:.0%}"
              f"{describe_misses(point, targets)}", file=sys.stderr)
        if paced_steps is not None and before is not None:
            (planned, late), (planned_before, late_before) = paced_steps(), before
            pacing.append({"request_rate": rate, "paced_steps": planned - planned_before,
                           "late_paced_steps": late - late_before})
            print(f"{label} at {rate:g} req/s: the decode worker planned {planned - planned_before:.0f} steps, "
                  f"{late - late_before:.0f} of them late", file=sys.stderr)
        if point.both < args.stop_below:
            break
    return points, pacing


def describe_misses(point: Attainment, targets: LatencyTargets) -> str:
    """Which prompts missed which target, so a reader sees whether length or load explains them."""
    parts = []
    for name, value_of, target in (("TTFT", lambda m: m.ttft_ms, targets.ttft_ms),
                                   ("inter-token", lambda m: m.itl_ms, targets.itl_ms)):
        missed = sorted((m for m in point.misses if m.error is None and (value_of(m) or 0) > target),
                        key=lambda m: m.num_prompt_tokens)
        if missed:
            prompts = ", ".join(f"{m.num_prompt_tokens:,}" for m in missed)
            parts.append(f"{name} missed by prompts of {prompts} tokens")
    failed = sum(m.error is not None for m in point.misses)
    if failed:
        parts.append(f"{failed} failed")
    return "; " + "; ".join(parts) if parts else ""


def report_table(runs: dict[str, list[Attainment]], targets: LatencyTargets, share: float) -> str:
    rates = sorted({p.request_rate for points in runs.values() for p in points})

    def cell(points: list[Attainment], rate: float) -> str:
        point = next((p for p in points if p.request_rate == rate), None)
        return "-" if point is None else f"{point.both:.0%} ({point.ttft:.0%} / {point.itl:.0%})"

    rows = [[f"{rate:g}", *(cell(points, rate) for points in runs.values())] for rate in rates]
    rows.append([f"**goodput** (>= {share:.0%} meet both)",
                 *(_rate_text(goodput(points, share)) for points in runs.values())])
    title = (f"targets: TTFT {targets.ttft_ms:.0f} ms, inter-token ({targets.itl_measure} of each request's gaps) "
             f"{targets.itl_ms:.0f} ms; cells: both (TTFT / inter-token)")

    def latencies(points: list[Attainment], rate: float) -> str:
        point = next((p for p in points if p.request_rate == rate), None)
        return "-" if point is None else f"{_ms_text(point.ttft_p50_ms)} / {_ms_text(point.itl_p99_ms)}"

    latency_rows = [[f"{rate:g}", *(latencies(points, rate) for points in runs.values())] for rate in rates]
    return (title + "\n\n" + format_table(["req/s", *runs], rows)
            + "\n\nTTFT p50 / inter-token p99 (ms, over every gap)\n\n" + format_table(["req/s", *runs], latency_rows))


def _ms_text(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _rate_text(rate: float | None) -> str:
    return "below the lowest rate" if rate is None else f"{rate:g} req/s"


def figure(runs: dict[str, list[Attainment]], share: float) -> Figure:
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    for label, points in runs.items():
        ax.plot([p.request_rate for p in points], [100 * p.both for p in points], marker="o", label=label)
    ax.axhline(100 * share, color="grey", linestyle="--", linewidth=1)
    ax.set(title="Requests meeting both latency targets", xlabel="request rate (req/s)",
           ylabel="attainment (%)", ylim=(0, 105))
    ax.legend()
    return fig


if __name__ == "__main__":
    sys.exit(main())
