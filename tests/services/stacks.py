"""Real stacks (worker and gateway processes) on the tests' Redis, as the service tests start them."""

from __future__ import annotations

import re
import signal
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from openai import OpenAI

from bench.stack_harness import scrape_metrics
from services.launcher import Stack, StackConfig
from shared.protocol import WorkerStatus, decode
from shared.settings import WorkerSettings
from shared.streams import Keys
from tests.services.stack_client import REDIS_URL

# fast heartbeats so that a dead worker is noticed within a second
FAST_HEARTBEAT = {"LLMD_WORKER__HEARTBEAT_INTERVAL_S": "0.2", "LLMD_WORKER__HEARTBEAT_TTL_S": "1"}
BOUND_S = 120.0  # generous: the machine is shared; never a claim about speed


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


def openai_client(stack: Stack) -> OpenAI:
    """An `openai` client of the stack's gateway that never retries, so every failure shows."""
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, timeout=BOUND_S)


def streamed_text(client: OpenAI, model: str, prompt: str, max_tokens: int,
                  on_chunk: Callable[[int], None] = lambda n: None, **sampling: Any) -> str:
    """One streamed completion that ignores EOS, so it must produce exactly max_tokens tokens
    (asserted); `on_chunk` gets the number of text chunks received so far after each."""
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True}, **sampling,
    )  # fmt: skip
    text, num_chunks, usage = "", 0, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            num_chunks += 1
            on_chunk(num_chunks)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == max_tokens
    return text


class HolderKiller:
    """An `on_chunk` for streamed_text: at chunk `at`, SIGKILLs the one `role` worker running the
    request (a worker's id is its name in the stack) and records it in `victims`."""

    def __init__(self, stack: Stack, rds: redis.Redis, role: str, at: int = 8) -> None:
        self.stack, self.rds, self.role, self.at = stack, rds, role, at
        self.victims: list[str] = []

    def __call__(self, num_chunks: int) -> None:
        if num_chunks != self.at or self.victims:
            return
        holders = request_holders(self.rds, self.stack.keys, self.role)
        assert len(holders) == 1, f"expected one {self.role} worker holding the request, got {holders}"
        self.victims.append(holders[0])
        assert self.stack.stop_worker(holders[0], signal.SIGKILL) < 0


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


def scrape(base_url: str) -> str:
    """The Prometheus exposition of a gateway (at its base URL) or a worker (at its health server)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        return response.read().decode()


def metric_value(stack: Stack, name: str, label: str) -> float:
    """The gateway's one sample of `name` whose labels include `label` (e.g. 'reason="deadline"')."""
    (value,) = re.findall(rf"^{name}{{[^}}]*{label}[^}}]*}} (\S+)$", scrape(stack.base_url), re.MULTILINE)
    return float(value)


def worker_tokens(stack: Stack) -> dict[str, float]:
    """Output tokens the gateway received from each worker (its llmd_worker_tokens_total series)."""
    pattern = r'^llmd_worker_tokens_total\{[^}]*worker_id="([^"]+)"\} (\S+)$'
    return {worker_id: float(value) for worker_id, value in re.findall(pattern, scrape(stack.base_url), re.MULTILINE)}


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
