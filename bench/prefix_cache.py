"""Comparison d: prefix caching on vs off, on the shared-prefix workload.

    python -m bench.prefix_cache [--num-prompts 48 --request-rate 0.25 --num-groups 4 --prefix-len 1024 \\
        --suffix-len 32 --output-len 32 --seed 0]

Two stacks, one after the other, each 1 prefill + 1 decode worker with the same settings except
LLMD_KV_CACHE__ENABLE_PREFIX_CACHING, get the same seeded requests at the same seeded Poisson
arrivals: --num-groups prefixes of --prefix-len tokens, each request one of them plus its own
--suffix-len tokens. The warm-up request has fresh tokens (shaped like the first request), so it
primes no prefix of the run. The hit rate is the prefill workers' vllm:prefix_cache_hits over
vllm:prefix_cache_queries (prompt tokens) during the timed run; every request goes to a prefill
worker (LLMD_ROUTING__LOCAL_PREFILL_MAX_TOKENS=0: no decode worker prefills a request it caches).

The default rate keeps the machine below saturation with caching off (on 2 CPU cores one
1,056-token prefill takes about 2 s), so the ratio measures prefill work, not queueing.
Prints a Markdown table, writes bench/results/prefix_cache.json and bench/results/prefix_cache.png.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from bench.serving.client import RequestResult
from bench.serving.metrics import BenchmarkMetrics
from bench.serving.report import result_document
from bench.serving.runner import LoadSpec
from bench.serving.workload import WorkloadSpec, build_workload, warmup_requests
from bench.stack_harness import (
    format_table,
    metric_sum,
    run_load,
    scrape_workers,
    stack_config,
    vocab_ids,
    warm_up,
    write_figure,
    write_result,
)
from services.launcher import Stack

NAME = "prefix_cache"
CACHING_ENV = "LLMD_KV_CACHE__ENABLE_PREFIX_CACHING"
MODES = (("off", False), ("on", True))
TARGET_RATIO = 3.0  # the issue's: prefix caching cuts the mean TTFT at least 3x
MIB = 2**20
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "llmd_handoff_bytes_total")


@dataclass(slots=True)
class ModeRun:
    mode: str
    metrics: BenchmarkMetrics
    results: list[RequestResult]
    counters: dict[str, float]  # prefill workers' counter increments during the timed run

    @property
    def hit_rate(self) -> float:
        queries = self.counters["vllm:prefix_cache_queries_total"]
        return self.counters["vllm:prefix_cache_hits_total"] / queries if queries else 0.0

    @property
    def handoff_mib_per_request(self) -> float:
        return self.counters["llmd_handoff_bytes_total"] / MIB / max(1, self.metrics.num_completed)

    def ttft_ms(self, stat: str) -> float:
        dist = self.metrics.ttft_ms
        if dist is None:
            return float("nan")
        return dist.mean if stat == "mean" else dist.percentiles[stat]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefix_cache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--request-rate", type=float, default=0.25, help="requests/s, Poisson arrivals")
    parser.add_argument("--max-concurrency", type=int, help="cap on requests in flight (1: one at a time)")
    parser.add_argument("--num-groups", type=int, default=4, help="number of shared prefixes")
    parser.add_argument("--prefix-len", type=int, default=1024, help="tokens per shared prefix")
    parser.add_argument("--suffix-len", type=int, default=32, help="unique tokens per request")
    parser.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=NAME, help="results go to bench/results/NAME.json and NAME.png")
    return parser


def run_mode(mode: str, caching: bool, spec: WorkloadSpec, load: LoadSpec, seed: int) -> ModeRun:
    vocab = vocab_ids()
    requests = build_workload(spec, vocab, seed)
    print(f"prefix caching {mode}: starting a stack", file=sys.stderr, flush=True)
    # the prefill worker's cache is what is compared: no request goes to a decode worker that holds its prefix
    env = {CACHING_ENV: str(caching).lower(), "LLMD_ROUTING__LOCAL_PREFILL_MAX_TOKENS": "0"}
    with Stack(stack_config(env)) as stack:
        assert stack.base_url is not None, "stack_config starts a gateway"
        warm_up(stack.base_url, warmup_requests(requests, vocab, seed, 1))
        before = scrape_workers(stack, "prefill")
        cap = f", at most {load.max_concurrency} at once" if load.max_concurrency else ""
        rate = f"{load.request_rate:g}/s{cap}"
        print(f"prefix caching {mode}: {len(requests)} requests at {rate}", file=sys.stderr, flush=True)
        metrics, results = run_load(stack.base_url, requests, load)
        after = scrape_workers(stack, "prefill")
    counters = {name: metric_sum(after, name) - metric_sum(before, name) for name in COUNTERS}
    return ModeRun(mode, metrics, results, counters)


def summary_row(run: ModeRun) -> dict[str, Any]:
    return {
        "prefix_caching": run.mode,
        "completed": run.metrics.num_completed,
        "failed": run.metrics.num_failed,
        "ttft_mean_ms": run.ttft_ms("mean"),
        "ttft_p50_ms": run.ttft_ms("p50"),
        "ttft_p99_ms": run.ttft_ms("p99"),
        "output_throughput_tok_s": run.metrics.output_throughput,
        "prefix_cache_hit_rate": run.hit_rate,
        "handoff_mib_per_request": run.handoff_mib_per_request,
    }


def ttft_ratios(off: ModeRun, on: ModeRun) -> dict[str, float]:
    return {stat: off.ttft_ms(stat) / on.ttft_ms(stat) for stat in ("mean", "p50", "p99")}


def format_report(rows: list[dict[str, Any]], ratios: dict[str, float]) -> str:
    table = format_table(
        ["prefix caching", "ok/failed", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "output tok/s",
         "prefix-cache hit rate", "KV handoff MiB/req"],
        [[r["prefix_caching"], f"{r['completed']}/{r['failed']}", f"{r['ttft_mean_ms']:.1f}", f"{r['ttft_p50_ms']:.1f}",
          f"{r['ttft_p99_ms']:.1f}", f"{r['output_throughput_tok_s']:.2f}", f"{r['prefix_cache_hit_rate']:.1%}",
          f"{r['handoff_mib_per_request']:.2f}"] for r in rows],
    )  # fmt: skip
    verdict = "met" if ratios["mean"] >= TARGET_RATIO else "NOT met"
    return (
        f"{table}\n\nTTFT off/on: mean {ratios['mean']:.2f}x, p50 {ratios['p50']:.2f}x, p99 {ratios['p99']:.2f}x "
        f"(target: mean >= {TARGET_RATIO:g}x, {verdict})"
    )


def plot(runs: list[ModeRun]) -> Figure:
    fig = Figure(figsize=(11, 4), layout="constrained")
    cdf, bars = fig.subplots(1, 2)
    for run in runs:
        ttfts = np.sort([r.ttft_s * 1000 for r in run.results if r.success and r.ttft_s is not None])
        cdf.step(ttfts, np.arange(1, len(ttfts) + 1) / max(len(ttfts), 1), where="post",
                 label=f"caching {run.mode} (hit rate {run.hit_rate:.0%})")
    cdf.set(title="TTFT distribution", xlabel="TTFT (ms)", ylabel="fraction of requests", xscale="log", ylim=(0, 1))
    cdf.legend()
    stats = ("mean", "p50", "p99")
    x = np.arange(len(stats))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        bars.bar(x + i * width, [run.ttft_ms(s) for s in stats], width, label=f"caching {run.mode}")
    bars.set_xticks(x + width * (len(runs) - 1) / 2, stats)
    bars.set(title="TTFT", ylabel="ms")
    bars.legend()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        parser.error(f"need --request-rate > 0 (got {args.request_rate}) and --max-concurrency >= 1 "
                     f"(got {args.max_concurrency})")  # fmt: skip
    try:
        spec = WorkloadSpec(
            name="shared-prefix", num_prompts=args.num_prompts, output_len=args.output_len, num_groups=args.num_groups,
            prefix_len=args.prefix_len, suffix_len=args.suffix_len,
        )  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    load = LoadSpec(request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed)
    runs = [run_mode(mode, caching, spec, load, args.seed) for mode, caching in MODES]
    rows = [summary_row(run) for run in runs]
    ratios = ttft_ratios(off=runs[0], on=runs[1])
    print(format_report(rows, ratios))
    config = vars(args) | {"workload": "shared-prefix", "date": datetime.now(UTC).isoformat(timespec="seconds")}
    document = {
        "config": config,
        "summary": rows,
        "ttft_ratio_off_on": ratios,
        "target_met": ratios["mean"] >= TARGET_RATIO,
        "runs": {run.mode: result_document(config | {"prefix_caching": run.mode}, run.metrics, run.results)
                 | {"prefill_counter_deltas": run.counters} for run in runs},
    }  # fmt: skip
    print(f"results: {write_result(args.name, document)}", file=sys.stderr)
    print(f"plot: {write_figure(args.name, plot(runs))}", file=sys.stderr)
    return 0 if all(run.metrics.num_failed == 0 and run.metrics.num_completed > 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
