"""A stack's first start with an empty model cache (issue 25): a worker converts the model for
tens of seconds, and a worker already serving must not sweep the shared-memory marker of one
still loading, or every handoff to it would go through Redis. Here the decode worker starts with
an empty cache and the prefill worker with the warm one, so the prefill worker serves, and
sweeps, throughout the decode worker's conversion; the markers' TTL (3 x handoff_timeout_s) is
far below it, so a marker refreshed only by heartbeats would be swept."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.launcher import Stack
from shared.settings import WorkerSettings
from tests.services.stack_client import REDIS_URL
from tests.services.stacks import FAST_HEARTBEAT, kv_bytes_by_transport, live_workers, openai_client, running_stack
from tests.services.test_fault_real import greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def first_start(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> Iterator[Stack]:
    # capfd before the stack starts: the workers inherit the stderr it captures
    env = {"LLMD_KV_CACHE__MEMORY_BYTES": str(32 * 2**20), "LLMD_WORKER__HANDOFF_TIMEOUT_S": "1", **FAST_HEARTBEAT}
    empty_cache = {"decode": {"XDG_CACHE_HOME": str(tmp_path / "cache")}}
    with running_stack("first-start", env, role_env=empty_cache) as stack:
        yield stack


def test_no_worker_sweeps_the_marker_of_one_still_loading(first_start: Stack,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    stack = first_start
    rds = redis.Redis.from_url(REDIS_URL)
    statuses = [s for role in ("prefill", "decode") for s in live_workers(rds, stack.keys, role)]
    assert len(statuses) == 2 and all(s.kv_shm for s in statuses)
    shm_dir = Path(WorkerSettings().kv_shm_dir)
    assert all((shm_dir / f"llmd-{stack.namespace}-worker-{s.kv_shm}").exists() for s in statuses)

    with openai_client(stack) as client:
        greedy(client, client.models.list().data[0].id, "The KV of this prompt goes", max_tokens=4)

    by_transport = kv_bytes_by_transport(rds, stack.keys)
    rds.close()
    assert by_transport["shm"] > 0 and by_transport["redis"] == 0
    logs = capfd.readouterr().err  # the workers' stderr, which they inherit
    assert "abandoned KV transfers or markers" not in logs
    assert "KV marker" not in logs
