"""The comparisons' harness: Prometheus pages as a worker really serves them, workers found through
their heartbeats in a real Redis, result files, the prompt vocabulary."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from bench import result_files
from bench.stack_harness import format_table, metric_sum, scrape_metrics, vocab_ids, worker_metrics_urls, write_result
from services.runtime.health import create_health_app
from services.launcher import Stack, StackConfig
from shared.metrics import WorkerMetrics
from shared.protocol import WorkerStatus
from shared.settings import RedisSettings
from shared.streams import Bus

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


class MetricsOnly:
    """A worker's /health and /metrics server without its engine: the page is WorkerMetrics' own."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    def health(self) -> tuple[int, dict[str, Any]]:
        return 200, {"status": "ok"}

    def render_metrics(self) -> tuple[bytes, str]:
        return self.metrics.render(), self.metrics.content_type


@pytest.fixture
async def worker_page() -> AsyncIterator[tuple[WorkerMetrics, str]]:
    metrics = WorkerMetrics(model_name="m", worker_id='prefill-"0"')
    server = TestServer(create_health_app(MetricsOnly(metrics)), host="127.0.0.1")
    await server.start_server()
    yield metrics, str(server.make_url("/metrics"))
    await server.close()


async def test_scrape_reads_counters_histograms_and_escaped_labels(worker_page: tuple[WorkerMetrics, str]) -> None:
    metrics, url = worker_page
    metrics.handoff_bytes["shm"].inc(3 * 2**20)
    metrics.handoff_seconds.observe(0.25)
    metrics.handoff_seconds.observe(0.5)
    metrics.observe_pacing(lent_s=1.5, stream_pauses=2, paced_steps=10, paced_steps_late=1)
    # running totals: the counters take the increase
    metrics.observe_pacing(lent_s=2.0, stream_pauses=3, paced_steps=40, paced_steps_late=2)

    # the page is read synchronously, so off the loop that serves it
    samples = await asyncio.to_thread(scrape_metrics, url)

    labels = 'model_name="m",worker_id="prefill-\\"0\\""'
    by_transport = 'model_name="m",transport="{}",worker_id="prefill-\\"0\\""'
    assert samples[f"llmd_handoff_bytes_total{{{by_transport.format('shm')}}}"] == 3 * 2**20
    assert samples[f"llmd_handoff_bytes_total{{{by_transport.format('redis')}}}"] == 0
    assert samples[f"llmd_handoff_seconds_count{{{labels}}}"] == 2
    assert samples[f"llmd_handoff_seconds_sum{{{labels}}}"] == 0.75
    assert samples[f'llmd_handoff_seconds_bucket{{le="0.25",{labels}}}'] == 1
    assert samples[f"vllm:prefix_cache_hits_total{{{labels}}}"] == 0
    assert samples[f"llmd_lent_seconds_total{{{labels}}}"] == 2.0
    assert samples[f"llmd_stream_pauses_total{{{labels}}}"] == 3
    assert samples[f"llmd_paced_steps_total{{{labels}}}"] == 40
    assert samples[f"llmd_paced_steps_late_total{{{labels}}}"] == 2
    assert metric_sum(samples, "llmd_handoff_seconds_sum") == 0.75


def test_metric_sum_adds_every_series_of_one_name() -> None:
    samples = {'a_total{w="0"}': 1.0, 'a_total{w="1"}': 2.0, "a_total_other": 5.0, "a_total": 4.0}
    assert metric_sum(samples, "a_total") == 7.0
    assert metric_sum(samples, "missing") == 0.0


async def test_worker_urls_come_from_live_heartbeats() -> None:
    stack = Stack(StackConfig(redis_url=REDIS_URL, namespace=f"test-harness-{uuid.uuid4().hex[:8]}"))
    bus = Bus(RedisSettings(url=REDIS_URL, namespace=stack.namespace))

    def status(worker_id: str, health_port: int | None) -> WorkerStatus:
        return WorkerStatus(worker_id, "prefill", bus.keys.inbox(worker_id), 10, 10, 0, 0, time.time(),
                            health_port=health_port)  # fmt: skip

    try:
        await bus.publish_status(status("prefill-1", 9201), ttl_s=30)
        await bus.publish_status(status("prefill-0", 9200), ttl_s=30)
        await bus.publish_status(status("prefill-dead", 9202), ttl_s=30)
        await bus.redis.delete(bus.keys.alive("prefill-dead"))  # its heartbeat lapsed

        urls = await asyncio.to_thread(worker_metrics_urls, stack, "prefill")
        assert urls == ["http://127.0.0.1:9200/metrics", "http://127.0.0.1:9201/metrics"]
        assert await asyncio.to_thread(worker_metrics_urls, stack, "decode") == []

        await bus.publish_status(status("prefill-old", None), ttl_s=30)
        with pytest.raises(RuntimeError, match="prefill-old"):
            await asyncio.to_thread(worker_metrics_urls, stack, "prefill")
    finally:
        keys = [key async for key in bus.redis.scan_iter(f"{stack.namespace}:*")]
        if keys:
            await bus.redis.delete(*keys)
        await bus.close()


def test_write_result_writes_json_under_results_dir_with_the_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(result_files, "RESULTS_DIR", tmp_path / "results")
    document = {"summary": [{"x": 1.5}], "config": {"name": "t"}}
    path = write_result("t", document)
    assert path == tmp_path / "results" / "t.json"
    written = json.loads(path.read_text())
    assert {k: v for k, v in written.items() if k not in ("machine", "command")} == document
    assert written["command"].startswith("python ")
    assert written["machine"]["cores"] == os.cpu_count()
    assert {"cpu", "isa", "torch", "auto_dtype", "date", "commit"} <= written["machine"].keys()


def test_format_table_is_markdown() -> None:
    assert format_table(["a", "b"], [["1", "2"]]).splitlines() == ["| a | b |", "|---|---:|", "| 1 | 2 |"]


def test_vocab_ids_leave_out_special_tokens() -> None:
    ids = vocab_ids()
    # SmolLM2's special tokens: <|endoftext|>, <|im_start|>, <|im_end|>, out of 49,152
    assert ids.tolist() == list(range(3, 49152))
