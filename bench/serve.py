"""Load generator and reporter for any OpenAI-compatible completions server.

    python -m bench.serve --base-url http://127.0.0.1:8000 --model NAME --workload random \\
        --num-prompts 64 --input-len 256 --output-len 128 --request-rate inf --seed 0

Prints progress to stderr and the summary table to stdout; exits 1 when no request succeeded.
See docs/benchmarking.md for the workloads and the metric definitions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.result_files import save_result
from bench.serving.client import Target, fetch_model_name
from bench.serving.metrics import GoodputSLO, compute_metrics, parse_goodput, parse_percentiles
from bench.serving.report import format_summary, result_document
from bench.serving.runner import LoadSpec, run_benchmark
from bench.serving.workload import (
    WORKLOADS,
    BenchRequest,
    WorkloadSpec,
    as_text,
    build_workload,
    vocab_from_size,
    vocab_from_tokenizer,
    warmup_requests,
)


@dataclass(slots=True, frozen=True)
class Plan:
    """The validated command line: what to send, how, and how to judge it."""

    spec: WorkloadSpec
    load: LoadSpec
    percentiles: list[float]
    slo: GoodputSLO | None
    extra_body: dict[str, Any]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000")
    server.add_argument("--endpoint", default="/v1/completions")
    server.add_argument("--model", help="model name to send (default: the first one /v1/models lists)")
    server.add_argument("--api-key", help="sent as a Bearer token")
    server.add_argument("--timeout", type=float, default=300.0, help="per-request limit in seconds")
    server.add_argument("--extra-body", default="{}", help="JSON object merged into every request body")

    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", choices=WORKLOADS, default="random")
    workload.add_argument("--num-prompts", type=int, default=100)
    workload.add_argument("--input-len", type=int, default=256, help="random: prompt tokens; chat-mix: median")
    workload.add_argument("--output-len", type=int, default=128, help="tokens to generate; chat-mix: median")
    workload.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths in len*(1±r)")
    workload.add_argument("--num-groups", type=int, default=8, help="shared-prefix: number of prefixes")
    workload.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens per prefix")
    workload.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: unique tokens per request")
    workload.add_argument("--length-sigma", type=float, default=1.0, help="chat-mix: lognormal sigma")
    workload.add_argument("--max-input-len", type=int, help="chat-mix: clip (default 4x --input-len)")
    workload.add_argument("--max-output-len", type=int, help="chat-mix: clip (default 4x --output-len)")
    workload.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    workload.add_argument("--tokenizer", type=Path, help="tokenizer directory or .gguf file (needed for text)")
    workload.add_argument("--vocab-size", type=int, default=32000, help="id range without --tokenizer")
    workload.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    load.add_argument("--num-warmups", type=int, default=1, help="untimed requests sent first, one at a time")

    report = parser.add_argument_group("report")
    report.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    report.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft, tpot, e2el")
    report.add_argument("--result-json", type=Path)
    report.add_argument("--plot-dir", type=Path)
    report.add_argument("--progress-interval", type=float, default=1.0, help="seconds; 0 turns progress off")
    return parser


def make_plan(args: argparse.Namespace) -> Plan:
    """Raises ValueError on any invalid combination of options."""
    if args.prompt_format == "text" and args.tokenizer is None:
        raise ValueError("--prompt-format text needs --tokenizer")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.num_warmups < 0 or args.timeout <= 0:
        raise ValueError("--num-warmups must be >= 0 and --timeout > 0")
    extra_body = json.loads(args.extra_body)
    if not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    spec = WorkloadSpec(
        name=args.workload,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_groups=args.num_groups,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        length_sigma=args.length_sigma,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
    )
    load = LoadSpec(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        progress_interval_s=args.progress_interval,
    )
    slo = parse_goodput(args.goodput) if args.goodput else None
    return Plan(spec, load, parse_percentiles(args.percentiles), slo, extra_body)


def load_tokenizer(path: Path) -> Any:
    """The transformers tokenizer of a .gguf file or checkpoint folder (a GGUF's conversion is cached on disk)."""
    # transformers takes seconds to import; only text prompts and exact vocabularies need it.
    from shared.text.tokenizer import Tokenizer

    return Tokenizer.from_path(str(path)).hf


def prepare_requests(args: argparse.Namespace, plan: Plan) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """The timed requests and the warm-up requests, rendered in the chosen prompt format."""
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    vocab_ids: np.ndarray = (
        vocab_from_tokenizer(len(tokenizer), tokenizer.all_special_ids)
        if tokenizer
        else vocab_from_size(args.vocab_size)
    )
    requests = build_workload(plan.spec, vocab_ids, args.seed)
    warmups = warmup_requests(requests, vocab_ids, args.seed, args.num_warmups)
    if args.prompt_format == "text":
        assert tokenizer is not None, "make_plan requires --tokenizer for text prompts"
        return as_text(requests, tokenizer), as_text(warmups, tokenizer)
    return requests, warmups


async def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    async with aiohttp.ClientSession() as session:
        return await fetch_model_name(session, args.base_url.rstrip("/"), args.timeout)


async def run(args: argparse.Namespace, plan: Plan) -> int:
    requests, warmups = prepare_requests(args, plan)
    model = await resolve_model(args)
    target = Target(
        url=args.base_url.rstrip("/") + args.endpoint,
        model=model,
        timeout_s=args.timeout,
        api_key=args.api_key,
        extra_body=plan.extra_body,
    )
    print(f"{plan.spec.name}: {len(requests)} requests to {target.url} ({model})", file=sys.stderr)
    outcome = await run_benchmark(target, requests, plan.load, warmups)
    metrics = compute_metrics(outcome.results, outcome.duration_s, plan.percentiles, plan.slo)
    print(format_summary(metrics))
    document = result_document(run_config(args, model), metrics, outcome.results)
    if args.result_json:
        save_result(args.result_json, document)
        print(f"results: {args.result_json}", file=sys.stderr)
    if args.plot_dir:
        from bench.serving.plots import write_plots  # matplotlib is only needed for plots

        for path in write_plots(document["requests"], args.plot_dir):
            print(f"plot: {path}", file=sys.stderr)
    return 0 if metrics.num_completed > 0 else 1


def run_config(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The command line as recorded in the result document (without the API key)."""
    config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    del config["api_key"]
    return config | {"model": model, "date": datetime.now(UTC).isoformat(timespec="seconds")}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return asyncio.run(run(args, plan))
    # WarmupError is a RuntimeError; the others come from asking /v1/models.
    except (RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
