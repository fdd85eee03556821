"""Faults with real processes: a prefill worker SIGKILLed while it holds unacknowledged requests,
a private Redis restarted empty under a running stack, and Redis over TLS (`rediss://`)."""

from __future__ import annotations

import datetime
import ipaddress
import signal
import subprocess
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from openai import APIError, OpenAI

from services.launcher import RedisServer, Stack, StackConfig, free_port
from services.launcher.redis_server import find_redis_server
from shared.protocol import Cancel
from shared.settings import RedisSettings
from shared.streams import PREFILL_GROUP, Bus
from tests.services.stack_client import REDIS_URL
from tests.services.stacks import BOUND_S, FAST_HEARTBEAT, openai_client, remove_kv_files
from tests.services.test_faults import assert_clean, requests_streams, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KV_BYTES = 256 * 2**20  # room for every long prompt at once on the one decode worker
NUM_REQUESTS = 4
NUM_TOKENS = 16
IN_FLIGHT_TOKENS = 60  # long enough to still be running when Redis goes away
# long prompts keep the prefill worker busy (entries pending) long enough to be killed mid-way
PROMPTS = [f"Story {i}: " + "the tide came in over the old stone harbour wall and " * 60 for i in range(NUM_REQUESTS)]


def config(redis_url: str, num_prefill: int, num_decode: int) -> StackConfig:
    return StackConfig(
        port=0, num_prefill=num_prefill, num_decode=num_decode, redis_url=redis_url,
        namespace=f"test-fault-real-{uuid.uuid4().hex[:8]}", dtype="float32",
        # a rerun's prompts are cached on the decode worker, which would prefill them itself: these faults
        # are about the prefill workers holding them
        env={"LLMD_KV_CACHE__MEMORY_BYTES": str(KV_BYTES), "LLMD_LOG_LEVEL": "WARNING",
             "LLMD_ROUTING__LOCAL_PREFILL_MAX_TOKENS": "0", **FAST_HEARTBEAT},
    )  # fmt: skip


@contextmanager
def fault_stack(config: StackConfig) -> Iterator[Stack]:
    try:
        with Stack(config) as stack:
            yield stack
    finally:
        remove_kv_files(config.namespace)  # the killed workers' markers


def greedy(client: OpenAI, model: str, prompt: str, max_tokens: int = NUM_TOKENS) -> str:
    """Streams one greedy completion; asserts it produced exactly `max_tokens` tokens."""
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
    )  # fmt: skip
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == max_tokens
    return text


def run_all(client: OpenAI, model: str) -> tuple[list[threading.Thread], dict[int, str], dict[int, BaseException]]:
    texts: dict[int, str] = {}
    errors: dict[int, BaseException] = {}

    def one(i: int) -> None:
        try:
            texts[i] = greedy(client, model, PROMPTS[i])
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(NUM_REQUESTS)]
    for t in threads:
        t.start()
    return threads, texts, errors


def join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(BOUND_S)
        assert not t.is_alive(), f"a request did not finish within {BOUND_S:.0f}s"


def test_a_prefill_worker_killed_holding_pending_requests_loses_and_doubles_nothing() -> None:
    with fault_stack(config(REDIS_URL, num_prefill=2, num_decode=1)) as stack, openai_client(stack) as client:
        rds = redis.Redis.from_url(REDIS_URL)
        try:
            model = client.models.list().data[0].id
            threads, expected, errors = run_all(client, model)  # fault-free reference, same concurrency
            join(threads)
            assert errors == {} and len(expected) == NUM_REQUESTS

            threads, texts, errors = run_all(client, model)
            holders: Counter[str] = Counter()

            def someone_holds_entries() -> bool:
                # on the shared stream, or routed to the worker that cached the prompt in the first run
                pending = [p for stream in requests_streams(rds, stack.keys)
                           for p in rds.xpending_range(stream, PREFILL_GROUP, min="-", max="+", count=100)]
                holders.update(p["consumer"].decode() for p in pending)
                return bool(pending) or not any(t.is_alive() for t in threads)

            until(someone_holds_entries, "a prefill worker to hold unacknowledged requests")
            assert holders, "every request finished before a prefill worker was seen holding one"
            victim = holders.most_common(1)[0][0]
            assert stack.stop_worker(victim, signal.SIGKILL) == -signal.SIGKILL
            join(threads)

            assert errors == {}
            assert texts == expected  # each request once, in full: nothing lost, nothing doubled
            assert_clean(rds, stack.keys)
            assert stack.exited() == {}
            for key in rds.scan_iter(f"{stack.namespace}:*"):
                rds.delete(key)
        finally:
            rds.close()


def test_workers_and_gateway_recover_when_redis_restarts_empty(redis_server: RedisServer) -> None:
    with fault_stack(config(redis_server.url, num_prefill=1, num_decode=1)) as stack, openai_client(stack) as client:
        model = client.models.list().data[0].id
        prompt = "Once upon a time, in a village by the sea,"
        expected = greedy(client, model, prompt)

        in_flight: dict[str, object] = {}
        started = threading.Event()

        def long_request() -> None:
            try:
                stream = client.completions.create(
                    model=model, prompt=prompt, max_tokens=IN_FLIGHT_TOKENS, temperature=0.0, stream=True,
                    extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
                )  # fmt: skip
                for chunk in stream:
                    started.set()
                    if chunk.usage is not None:
                        in_flight["completion_tokens"] = chunk.usage.completion_tokens
            except APIError as e:
                in_flight["error"] = e
            finally:
                started.set()

        thread = threading.Thread(target=long_request, daemon=True)
        thread.start()
        assert started.wait(BOUND_S)
        redis_server.stop()
        redis_server.start()

        # the in-flight request ends within the bound: either re-queued and completed, or a clear error
        thread.join(BOUND_S)
        assert not thread.is_alive(), f"the in-flight request neither finished nor failed in {BOUND_S:.0f}s"
        completed = in_flight.get("completion_tokens") == IN_FLIGHT_TOKENS
        assert completed or isinstance(in_flight.get("error"), APIError), in_flight

        assert greedy(client, model, prompt) == expected  # consumer groups recreated, gateway serving again
        assert stack.exited() == {}
        rds = redis.Redis.from_url(redis_server.url)
        try:
            assert_clean(rds, stack.keys)
        finally:
            rds.close()


def _self_signed(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))  # fmt: skip
    return cert_path, key_path


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    pytest.importorskip("cryptography", reason="the `cryptography` package makes the test certificate")
    cert, key = _self_signed(tmp_path)
    port = free_port()
    process = subprocess.Popen(
        [find_redis_server(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
         "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    probe = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(cert), socket_timeout=1)
    try:
        def up() -> bool:
            if process.poll() is not None:
                return True
            try:
                return bool(probe.ping())
            except redis.exceptions.ConnectionError:
                return False

        until(up, "redis-server to listen on its TLS port")
        if process.poll() is not None:
            output = process.stdout.read().decode(errors="replace") if process.stdout else ""
            pytest.skip(f"this redis-server cannot serve TLS (built without it?): {output.strip()[-300:]}")
        yield port, cert
    finally:
        probe.close()
        if process.poll() is None:
            process.terminate()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


async def test_bus_speaks_tls_with_a_rediss_url(tls_redis: tuple[int, Path]) -> None:
    port, ca = tls_redis
    bus = Bus(RedisSettings(
        url=f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required",
        namespace=f"tls-{uuid.uuid4().hex[:8]}", socket_timeout_s=5,
    ))  # fmt: skip
    try:
        assert await bus.ping()
        kwargs = bus.redis.connection_pool.connection_kwargs
        assert (kwargs["ssl_ca_certs"], kwargs["ssl_cert_reqs"]) == (str(ca), "required")  # verified, not trust-all
        entry_id = await bus.send(bus.keys.requests, Cancel(req_id="r-tls"))
        assert [e for e, _ in await bus.redis.xrange(bus.keys.requests)] == [entry_id]
    finally:
        await bus.close()
