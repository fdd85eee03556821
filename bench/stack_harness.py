"""What the stack comparisons (bench/prefix_cache.py, bench/handoff.py, ...) share: start a stack,
load it through the gateway, read the workers' Prometheus counters, and store the results.

    vocab_ids(model="default") -> np.ndarray
        token ids usable in random prompts: the model's vocabulary without special tokens
    stack_config(env, num_prefill=1, num_decode=1) -> StackConfig
        a stack on a free port in its own Redis namespace, workers logging warnings only; `env`
        carries the settings under comparison, e.g. {"LLMD_KV_CACHE__ENABLE_PREFIX_CACHING": "false"}
    run_load(base_url, requests, load, warmups=(), percentiles=(50, 99))
            -> tuple[BenchmarkMetrics, list[RequestResult]]
        streams `requests` to the gateway's /v1/completions as `bench.serve` does (model name
        from /v1/models, `warmups` first and untimed), progress on stderr
    warm_up(base_url, requests) -> None
        send `requests` one at a time, untimed and quietly; raises if one fails. Call it before
        reading the counters that the timed run is judged by, so the warm-up does not count
    scrape_metrics(url) -> dict[str, float]
        the samples of a Prometheus text page ("http://.../metrics"), keyed 'name{a="x",b="y"}'
        (plain 'name' without labels); counters carry their "_total" suffix
    parse_metrics(text) -> dict[str, float]
        the same of a page's text
    metric_sum(samples, name) -> float
        the sum of every series of `name` (all label values), e.g. over several workers' pages
    worker_metrics_urls(stack, role) -> list[str]
        the /metrics URL of each live worker of `role` ("prefill" or "decode"), from its heartbeat
    worker_metrics_by_id(stack, role) -> dict[str, str]
        the same URLs keyed by worker id, which is the worker's name in `stack.process_ids()`
    scrape_workers(stack, role) -> dict[str, float]
        every live worker of `role` scraped into one dict (their series differ in `worker_id`)
    median_item(items, key) -> item
        the item of median `key` (of an even count, the lower middle one): one run's figures stay together
    write_result(name, document) -> Path, write_figure(name, figure) -> Path
        bench/results/<name>.json (stamped with the machine) and .png, from bench/result_files.py
    format_table(header, rows) -> str
        a Markdown table, as docs/benchmarks.md shows them

Typical use:

    with Stack(stack_config({"LLMD_KV_CACHE__ENABLE_PREFIX_CACHING": "true"})) as stack:
        warm_up(stack.base_url, warmups)
        before = scrape_workers(stack, "prefill")
        metrics, results = run_load(stack.base_url, requests, LoadSpec(request_rate=1.0))
        after = scrape_workers(stack, "prefill")
    hits = metric_sum(after, "vllm:prefix_cache_hits_total") - metric_sum(before, "vllm:prefix_cache_hits_total")
"""

from __future__ import annotations

import asyncio
import functools
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.result_files import RESULTS_DIR, write_figure, write_result
from bench.serve import load_tokenizer
from bench.serving.client import RequestResult, Target, fetch_model_name
from bench.serving.compare import format_markdown
from bench.serving.metrics import BenchmarkMetrics, compute_metrics
from bench.serving.runner import LoadSpec, run_benchmark
from bench.serving.workload import BenchRequest, vocab_from_tokenizer
from services.launcher import Stack, StackConfig
from shared.model.paths import resolve_model_path
from shared.protocol import WorkerStatus
from shared.settings import RedisSettings
from shared.streams import Bus

T = TypeVar("T")

REQUEST_TIMEOUT_S = 600.0  # long prompts queue behind each other on a CPU-only machine
SCRAPE_TIMEOUT_S = 30.0
WORKER_HOST = "127.0.0.1"  # a Stack's workers run on this machine


@functools.cache
def vocab_ids(model: str = "default") -> np.ndarray:
    tokenizer = load_tokenizer(resolve_model_path(model))
    ids = vocab_from_tokenizer(len(tokenizer), tokenizer.all_special_ids)
    ids.flags.writeable = False  # cached: every caller gets this same array
    return ids


def stack_config(env: Mapping[str, str], num_prefill: int = 1, num_decode: int = 1) -> StackConfig:
    return StackConfig(
        port=0, num_prefill=num_prefill, num_decode=num_decode,
        # own namespace: harmless with a private Redis, isolating with a shared one ($REDIS_URL)
        namespace=f"bench-{uuid.uuid4().hex[:8]}",
        env={"LLMD_LOG_LEVEL": "WARNING", **env},
    )  # fmt: skip


def run_load(
    base_url: str,
    requests: list[BenchRequest],
    load: LoadSpec,
    warmups: Sequence[BenchRequest] = (),
    percentiles: Sequence[float] = (50, 99),
) -> tuple[BenchmarkMetrics, list[RequestResult]]:
    return asyncio.run(_run_load(base_url.rstrip("/"), requests, load, warmups, list(percentiles)))


async def _run_load(
    base_url: str,
    requests: list[BenchRequest],
    load: LoadSpec,
    warmups: Sequence[BenchRequest],
    percentiles: list[float],
) -> tuple[BenchmarkMetrics, list[RequestResult]]:
    async with aiohttp.ClientSession() as session:
        model = await fetch_model_name(session, base_url, SCRAPE_TIMEOUT_S)
    target = Target(url=f"{base_url}/v1/completions", model=model, timeout_s=REQUEST_TIMEOUT_S)
    outcome = await run_benchmark(target, requests, load, warmups)
    return compute_metrics(outcome.results, outcome.duration_s, percentiles), outcome.results


def warm_up(base_url: str, requests: Sequence[BenchRequest]) -> None:
    if not requests:
        return
    metrics, _ = run_load(base_url, list(requests), LoadSpec(max_concurrency=1, progress_interval_s=0))
    if metrics.num_failed:
        raise RuntimeError(f"{metrics.num_failed} of {len(requests)} warm-up requests failed: {metrics.failures}")


def scrape_metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
        return parse_metrics(response.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    return {
        _series_key(sample.name, sample.labels): float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_sum(samples: Mapping[str, float], name: str) -> float:
    return sum(value for key, value in samples.items() if key.partition("{")[0] == name)


def worker_metrics_urls(stack: Stack, role: str) -> list[str]:
    return list(worker_metrics_by_id(stack, role).values())


def worker_metrics_by_id(stack: Stack, role: str) -> dict[str, str]:
    statuses = asyncio.run(_live_workers(stack, role))
    missing = [s.worker_id for s in statuses if s.health_port is None]
    if missing:
        raise RuntimeError(f"workers {missing} publish no health port (built before WorkerStatus.health_port?)")
    return {s.worker_id: f"http://{WORKER_HOST}:{s.health_port}/metrics"
            for s in sorted(statuses, key=lambda s: s.worker_id)}


def scrape_workers(stack: Stack, role: str) -> dict[str, float]:
    return {key: value for url in worker_metrics_urls(stack, role) for key, value in scrape_metrics(url).items()}


async def _live_workers(stack: Stack, role: str) -> list[WorkerStatus]:
    assert stack.redis_url is not None, "the stack has been started"
    bus = Bus(RedisSettings(url=stack.redis_url, namespace=stack.namespace))
    try:
        return await bus.live_workers(role)
    finally:
        await bus.close()


def median_item(items: Sequence[T], key: Callable[[T], float]) -> T:
    return sorted(items, key=key)[(len(items) - 1) // 2]


def format_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    return format_markdown([list(header), *(list(row) for row in rows)])


def _series_key(name: str, labels: Mapping[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


def _escape(value: str) -> str:
    # the exposition format's escapes, so a key reads as the series does on the page
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
