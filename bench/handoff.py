"""The prefill -> decode KV handoff by prompt length, through one transport.

    python -m bench.handoff [--lengths 128,512,2048,7168 --requests-per-length 4 --output-len 4 --seed 0]
                            [--transport shm|nixl|tcp|redis]

One stack (1 prefill + 1 decode worker, prefix caching off, every prompt fresh random tokens, so
each request moves its whole KV). For each length, one untimed warm-up, then the requests one at
a time; the prefill worker's /metrics before and after give per length:

- KV bytes per request (llmd_handoff_bytes) and per prompt token;
- handoffs streamed layer by layer while the prefill ran (llmd_handoffs_streamed: tcp, prompts of
  --stream-min-tokens and more); their handoff seconds are what was left after the prefill, the
  exposed part;
- handoff seconds (llmd_handoff_seconds): from the end of the request's prefill to KVReady sent,
  i.e. offer, the decode worker's accept, and moving the blocks: into the workers' shared
  /dev/shm (shm), read by the decode worker through NIXL straight into its reserved blocks
  (nixl: until it says it has them), over the decode worker's data port straight into its
  reserved blocks (tcp), or into Redis (redis) (services/prefill/worker.py::_observe_handoff);
  MiB/s = bytes / those seconds;
  every byte must go by the chosen transport (llmd_handoff_bytes{transport}), or the run fails;
- TTFT on the prefill worker (vllm:time_to_first_token_seconds: requests stream -> first token).

The first token is sent before the handoff starts, so TTFT does not wait for it: the handoff
delays the second token. Hence three shares: of client TTFT (the worker log's figure), of
client ITL[0] (the first -> second token gap, which it sits inside), and of the time to the
second token (TTFT + ITL[0]).
Prints a Markdown table, writes bench/results/handoff.json and bench/results/handoff.png.
"""

from __future__ import annotations

import argparse
import os
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

NAME = "handoff"
TRANSPORTS = ("shm", "nixl", "tcp", "redis")
# NIXL between two hosts, simulated: on one host UCX would otherwise move the bytes through shared memory
UCX_ON_LOOPBACK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
MIB = 2**20
COUNTERS = (
    "llmd_handoff_bytes_total",
    "llmd_handoff_seconds_sum",
    "llmd_handoff_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "llmd_handoffs_streamed_total",
)


@dataclass(slots=True)
class LengthRun:
    prompt_len: int
    metrics: BenchmarkMetrics
    results: list[RequestResult]
    counters: dict[str, float]  # the prefill worker's counter increments during the timed requests

    def row(self) -> dict[str, Any]:
        c = self.counters
        num_handoffs = c["llmd_handoff_seconds_count"]
        if num_handoffs == 0:
            raise RuntimeError(f"no handoff was recorded for prompts of {self.prompt_len} tokens")
        done = [r for r in self.results if r.success and len(r.chunk_times_s) >= 2]
        ttft_s = float(np.mean([r.chunk_times_s[0] for r in done])) if done else float("nan")
        itl0_s = float(np.mean([r.itl_s[0] for r in done])) if done else float("nan")
        handoff_s = c["llmd_handoff_seconds_sum"] / num_handoffs
        bytes_per_request = c["llmd_handoff_bytes_total"] / num_handoffs
        worker_ttfts = c["vllm:time_to_first_token_seconds_count"]
        return {
            "prompt_tokens": self.prompt_len,
            "completed": self.metrics.num_completed,
            "failed": self.metrics.num_failed,
            "handoffs": int(num_handoffs),
            "streamed": int(c["llmd_handoffs_streamed_total"]),
            "kv_bytes_per_request": bytes_per_request,
            "kv_bytes_per_token": bytes_per_request / self.prompt_len,
            "handoff_mean_s": handoff_s,
            "handoff_mib_s": c["llmd_handoff_bytes_total"] / MIB / c["llmd_handoff_seconds_sum"],
            "ttft_client_mean_s": ttft_s,
            "ttft_worker_mean_s": c["vllm:time_to_first_token_seconds_sum"] / worker_ttfts if worker_ttfts else None,
            "itl0_client_mean_s": itl0_s,
            "handoff_share_of_ttft": handoff_s / ttft_s,
            "handoff_share_of_itl0": handoff_s / itl0_s,
            "handoff_share_of_second_token": handoff_s / (ttft_s + itl0_s),
        }


def parse_lengths(text: str) -> list[int]:
    lengths = [int(part) for part in text.split(",") if part.strip()]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths {text!r} must be a comma-separated list of positive token counts")
    return lengths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.handoff", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="128,512,2048,7168", help="prompt lengths in tokens (context: 8192)")
    parser.add_argument("--requests-per-length", type=int, default=4, help="timed requests, sent one at a time")
    parser.add_argument("--output-len", type=int, default=4, help="tokens per request; >= 2 to see the 2nd token")
    parser.add_argument("--warmups", type=int, default=1, help="untimed requests per length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=NAME, help="results go to bench/results/NAME.json and NAME.png")
    parser.add_argument("--transport", default="shm", choices=TRANSPORTS,
                        help="shm: the workers' shared /dev/shm (the default on one host); nixl: NIXL's UCX backend "
                        "(over TCP on loopback unless UCX_TLS is set); tcp: the decode worker's data port (the default "
                        "across hosts without NIXL); redis: Redis only")
    parser.add_argument("--stream-min-tokens", type=int, default=None,
                        help="LLMD_WORKER__KV_STREAM_MIN_TOKENS: prompts this long stream their KV layer by layer "
                        "over the data port while they prefill (default: the worker's, 512; 0: never)")
    return parser


def run_length(stack: Stack, prompt_len: int, args: argparse.Namespace, seed: int) -> LengthRun:
    assert stack.base_url is not None, "stack_config starts a gateway"
    vocab = vocab_ids()
    spec = WorkloadSpec(name="random", num_prompts=args.requests_per_length, input_len=prompt_len,
                        output_len=args.output_len)  # fmt: skip
    requests = build_workload(spec, vocab, seed)
    print(f"{prompt_len} tokens: {args.warmups} warm-up + {len(requests)} requests", file=sys.stderr, flush=True)
    warm_up(stack.base_url, warmup_requests(requests, vocab, seed, args.warmups))
    before = scrape_workers(stack, "prefill")
    metrics, results = run_load(stack.base_url, requests, LoadSpec(max_concurrency=1))
    after = scrape_workers(stack, "prefill")
    counters = {name: metric_sum(after, name) - metric_sum(before, name) for name in COUNTERS}
    elsewhere = {t: n for t in TRANSPORTS if t != args.transport and (n := bytes_by(after, t) - bytes_by(before, t))}
    if elsewhere:
        raise RuntimeError(f"KV bytes went by {elsewhere}, not only by {args.transport}")
    return LengthRun(prompt_len, metrics, results, counters)


def bytes_by(samples: dict[str, float], transport: str) -> float:
    label = f'transport="{transport}"'
    return sum(v for k, v in samples.items() if k.startswith("llmd_handoff_bytes_total{") and label in k)


def format_report(rows: list[dict[str, Any]]) -> str:
    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1000:.1f}"

    return format_table(
        ["prompt tokens", "ok/failed", "streamed", "KV MiB/req", "KV KiB/token", "handoff ms", "handoff MiB/s", "TTFT ms",
         "TTFT ms (prefill worker)", "ITL[0] ms", "handoff % of TTFT", "handoff % of ITL[0]",
         "handoff % of 2nd-token time"],
        [[str(r["prompt_tokens"]), f"{r['completed']}/{r['failed']}", str(r["streamed"]),
          f"{r['kv_bytes_per_request'] / MIB:.2f}",
          f"{r['kv_bytes_per_token'] / 1024:.1f}", ms(r["handoff_mean_s"]), f"{r['handoff_mib_s']:.0f}",
          ms(r["ttft_client_mean_s"]), ms(r["ttft_worker_mean_s"]), ms(r["itl0_client_mean_s"]),
          f"{r['handoff_share_of_ttft']:.0%}", f"{r['handoff_share_of_itl0']:.0%}",
          f"{r['handoff_share_of_second_token']:.0%}"] for r in rows],
    )  # fmt: skip


def plot(rows: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(11, 4), layout="constrained")
    times, rate = fig.subplots(1, 2)
    lengths = [r["prompt_tokens"] for r in rows]
    for key, label in (("ttft_client_mean_s", "TTFT"), ("itl0_client_mean_s", "ITL[0] (1st -> 2nd token)"),
                       ("handoff_mean_s", "handoff (prefill worker)")):  # fmt: skip
        times.plot(lengths, [r[key] * 1000 for r in rows], marker="o", label=label)
    times.set(title="Latency by prompt length", xlabel="prompt tokens", ylabel="ms (mean)", xscale="log", yscale="log")
    times.legend()
    rate.plot(lengths, [r["handoff_mib_s"] for r in rows], marker="o", color="tab:green")
    rate.set(title="KV handoff throughput", xlabel="prompt tokens", ylabel="MiB/s", xscale="log")
    size = rate.twinx()
    size.plot(lengths, [r["kv_bytes_per_request"] / MIB for r in rows], marker="s", color="tab:gray", linestyle="--")
    size.set(ylabel="KV MiB per request (dashed)")
    for ax in (times, rate):
        ax.set_xticks(lengths, [str(n) for n in lengths], minor=False)
        ax.minorticks_off()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        lengths = parse_lengths(args.lengths)
    except ValueError as exc:
        parser.error(str(exc))
    if args.output_len < 2 or args.requests_per_length < 1 or args.warmups < 0:
        parser.error(f"need --output-len >= 2 (got {args.output_len}), --requests-per-length >= 1 "
                     f"(got {args.requests_per_length}) and --warmups >= 0 (got {args.warmups})")  # fmt: skip
    print(f"starting a stack (1 prefill + 1 decode, prefix caching off, KV through {args.transport})",
          file=sys.stderr, flush=True)
    env = {"LLMD_KV_CACHE__ENABLE_PREFIX_CACHING": "false", "LLMD_WORKER__KV_TRANSPORT": args.transport}
    if args.stream_min_tokens is not None:
        env["LLMD_WORKER__KV_STREAM_MIN_TOKENS"] = str(args.stream_min_tokens)
    if args.transport == "nixl" and "UCX_TLS" not in os.environ:
        env |= UCX_ON_LOOPBACK
    with Stack(stack_config(env)) as stack:
        # a seed per length: prompts of different lengths share no tokens
        runs = [run_length(stack, n, args, args.seed + i) for i, n in enumerate(lengths)]
    rows = [run.row() for run in runs]
    print(format_report(rows))
    config = vars(args) | {"date": datetime.now(UTC).isoformat(timespec="seconds")}
    document = {
        "config": config,
        "summary": rows,
        "runs": {str(run.prompt_len): result_document(config | {"prompt_len": run.prompt_len}, run.metrics, run.results)
                 | {"prefill_counter_deltas": run.counters} for run in runs},
    }  # fmt: skip
    print(f"results: {write_result(args.name, document)}", file=sys.stderr)
    print(f"plot: {write_figure(args.name, plot(rows))}", file=sys.stderr)
    return 0 if all(run.metrics.num_failed == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
