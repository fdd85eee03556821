"""Real stacks (worker and gateway processes) on the tests' Redis, as the service tests start them."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from bench.stack_harness import scrape_metrics
from services.launcher import Stack, StackConfig
from shared.protocol import WorkerStatus, decode
from shared.settings import WorkerSettings
from shared.streams import Keys
from tests.services.stack_client import REDIS_URL

# fast heartbeats so that a dead worker is noticed within a second
FAST_HEARTBEAT = {"LLMD_WORKER__HEARTBEAT_INTERVAL_S": "0.2", "LLMD_WORKER__HEARTBEAT_TTL_S": "1"}


@contextmanager
def running_stack(name: str, env: dict[str, str], **config: Any) -> Iterator[Stack]:
    """A started stack in float32 with its own namespace on REDIS_URL, workers logging warnings;
    `config` sets other StackConfig fields. Its keys are deleted afterwards."""
    stack_config = StackConfig(
        port=0, redis_url=REDIS_URL, namespace=f"test-{name}-{uuid.uuid4().hex[:8]}", dtype="float32",
        env={"LLMD_LOG_LEVEL": "WARNING", **env}, **config,
    )  # fmt: skip
    try:
        with Stack(stack_config) as stack:
            yield stack
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(f"{stack_config.namespace}:*"):
            client.delete(key)
        client.close()
        remove_kv_files(stack_config.namespace)


def remove_kv_files(namespace: str) -> None:
    """What killed workers of a test deployment left in the KV directory (a live deployment
    sweeps it itself, but a test's namespace ends with the test)."""
    for path in Path(WorkerSettings().kv_shm_dir).glob(f"llmd-{namespace}-*"):
        path.unlink(missing_ok=True)


def request_holders(rds: redis.Redis, keys: Keys, role: str, timeout_s: float = 5.0) -> list[str]:
    """The live workers of `role` running a request, waiting up to timeout_s for a heartbeat that
    shows one: a worker reports its load once a heartbeat, and a fast decode streams several
    tokens of a request that started within the last one."""
    deadline = time.monotonic() + timeout_s
    while True:
        holders = [s.worker_id for s in live_workers(rds, keys, role) if s.num_running > 0]
        if holders or time.monotonic() > deadline:
            return holders
        time.sleep(0.02)


def live_workers(rds: redis.Redis, keys: Keys, role: str) -> list[WorkerStatus]:
    """The registered workers of `role` whose heartbeat is current."""
    statuses = [decode(v) for v in rds.hgetall(keys.workers(role)).values()]
    return [s for s in statuses if isinstance(s, WorkerStatus) and rds.exists(keys.alive(s.worker_id))]


def kv_bytes_by_transport(rds: redis.Redis, keys: Keys) -> dict[str, float]:
    """KV bytes the live prefill workers handed off, per transport (llmd_handoff_bytes)."""
    totals: dict[str, float] = {}
    for status in live_workers(rds, keys, "prefill"):
        for key, value in scrape_metrics(f"http://127.0.0.1:{status.health_port}/metrics").items():
            if key.startswith("llmd_handoff_bytes_total{") and (m := re.search(r'transport="(\w+)"', key)):
                totals[m[1]] = totals.get(m[1], 0.0) + value
    return totals


def prefill_metric(rds: redis.Redis, keys: Keys, name: str) -> dict[str, float]:
    """One counter of each live prefill worker, by worker id."""
    return {
        status.worker_id: sum(v for k, v in scrape_metrics(f"http://127.0.0.1:{status.health_port}/metrics").items()
                              if k.partition("{")[0] == name)
        for status in live_workers(rds, keys, "prefill")
    }
