"""Paged KV vs reserving each request's maximum length, on the same KV memory.

    python -m bench.kv_reservation [--num-requests 64] [--kv-tokens 16384]

bench.engine's seeded mixed workload, run twice with continuous batching on a KV pool of the
same size in bytes: once paged (blocks taken as a request grows), once reserving blocks for
prompt + max_tokens at admission (scheduler.kv_reservation = "max_length", the way servers
before PagedAttention allocated). Prints, per policy, the requests running per step (peak and
mean), the mean KV utilisation (slots holding live tokens / slots allocated), preemptions,
steps and output tokens/s; writes them to a JSON file and the running requests per step to a
PNG beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import get_args

import torch

from bench.engine import (
    EngineResult,
    add_workload_args,
    make_engine,
    run_engine,
    workload_from_args,
)
from bench.result_files import RESULTS_DIR, save_result
from shared.engine.engine import resolve_dtype
from shared.model.loader import load_model
from shared.model.runner import kv_block_bytes
from shared.settings import KVCacheSettings, KVReservation


def write_plot(results: dict[str, EngineResult], path: Path) -> None:
    from matplotlib.figure import Figure  # matplotlib is only needed for the plot

    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    for policy, result in results.items():
        ax.step(range(1, result.steps + 1), result.running_per_step, where="post", label=policy)
    ax.set(title="Requests running per engine step, same KV memory", xlabel="step", ylabel="running requests")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.add_argument("--kv-tokens", type=int, default=16384,
                        help="KV pool size in tokens (rounded up to whole blocks); the bytes follow from --dtype")
    parser.add_argument("--result-json", type=Path, default=RESULTS_DIR / "kv_reservation.json",
                        help="the PNG is written beside it, with the suffix .png")
    args = parser.parse_args(argv)

    loaded = load_model(args.model)
    work, workload = workload_from_args(args, loaded)
    block_size = KVCacheSettings().block_size
    num_blocks = -(-args.kv_tokens // block_size)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    kv_bytes = num_blocks * kv_block_bytes(loaded.config, block_size, dtype)
    print(f"KV pool: {num_blocks} blocks of {block_size} tokens, {kv_bytes / 2**20:.1f} MiB", file=sys.stderr)
    results = {policy: run_engine(make_engine(args, loaded, kv_bytes, policy), work, policy)
               for policy in get_args(KVReservation)}

    print("\n| KV reservation | peak running | mean running | mean KV utilisation | preemptions | steps | "
          "output tokens/s |\n|---|---|---|---|---|---|---|")
    for policy, r in results.items():
        print(f"| {policy} | {r.peak_running} | {r.mean_running:.1f} | {r.kv_utilization:.1%} | "
              f"{r.preemptions} | {r.steps} | {r.tokens_per_s:.1f} |")
    report = {
        "workload": workload,
        "dtype": str(dtype),
        "kv_pool": {"tokens": num_blocks * block_size, "bytes": kv_bytes, "block_size": block_size},
        "policies": {policy: r.summary() | {"running_per_step": r.running_per_step} for policy, r in results.items()},
    }
    save_result(args.result_json, report)
    write_plot(results, args.result_json.with_suffix(".png"))


if __name__ == "__main__":
    main()
