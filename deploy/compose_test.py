"""`make compose-test`: the Compose stack for real, on this host's container engine.

Builds the CPU image, starts the stack and waits for every service to be healthy, sends a
completion and a chat completion through the gateway, scales decode to two replicas and shows
each replica's share of the tokens, kills the decode container serving a streamed request and
checks that the stream still completes, then tears everything down. Prints the figures that
docs/deploy.md quotes. Needs only Python's standard library, an engine and its compose.

Environment:
  CONTAINER_ENGINE        docker (default) or podman
  COMPOSE                 the compose command (default "$CONTAINER_ENGINE compose"; or podman-compose)
  BASE_IMAGE, REDIS_IMAGE, TORCH_WHEELS
                          an offline host's images and torch index (deploy/offline_images.sh)
  GATEWAY_PUBLISHED_PORT  the gateway's port on this host (default 8000)
  TORCH_WHEELS_PORT       where TORCH_WHEELS is served on loopback during the build (default 18765)
  COMPOSE_TEST_NO_CACHE=1 build without the layer cache, to time a cold build
  LLMD_KV_CACHE__MEMORY_BYTES  each worker's KV pool (default here 512 MiB, equal for all)
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Its own project name, so that a stack the user runs under the file's name `llmd` is left alone.
PROJECT = "llmd-compose-test"
IMAGE = os.environ.get("CPU_IMAGE", "llmd:cpu")
HEALTHY_TIMEOUT_S = 600  # the first start of a worker loads the model and compiles its CPU kernel
STREAM_TOKENS = 200  # paced to the 200 ms inter-token target: still streaming when its worker is killed
KILL_AFTER_CHUNKS = 10
# A fixed port: the index URL is a build argument of the torch layer, so a new port each run would
# rebuild that layer and all after it.
WHEELS_PORT = int(os.environ.get("TORCH_WHEELS_PORT", "18765"))


class ComposeTestError(RuntimeError):
    pass


def run(*args: str) -> str:
    result = subprocess.run(args, cwd=REPO_ROOT, text=True, capture_output=True)
    if result.returncode != 0:
        raise ComposeTestError(f"`{shlex.join(args)}` exited {result.returncode}: {result.stderr[-2000:]}")
    return result.stdout


class Stack:
    def __init__(self, engine: str, compose: list[str], port: int) -> None:
        self.engine, self.compose_cmd, self.gateway = engine, compose, f"http://127.0.0.1:{port}"

    def compose(self, *args: str) -> str:
        return run(*self.compose_cmd, "-p", PROJECT, *args)

    def containers(self) -> dict[str, str]:
        """Each running container's hostname (a worker's id names it) -> its name."""
        ids = self.compose("ps", "-q").split()
        if not ids:
            return {}
        lines = run(self.engine, "inspect", "-f", "{{.Config.Hostname}} {{.Name}}", *ids).splitlines()
        return {host: name.lstrip("/") for host, name in (line.split() for line in lines)}

    def health(self) -> list[str]:
        """'/name status' of each running container."""
        ids = self.compose("ps", "-q").split()
        return run(self.engine, "inspect", "-f", "{{.Name}} {{.State.Health.Status}}", *ids).splitlines() if ids else []

    def wait_healthy(self) -> float:
        start = time.monotonic()
        while True:
            states = self.health()
            if states and all(state.endswith(" healthy") for state in states):
                return time.monotonic() - start
            if time.monotonic() - start > HEALTHY_TIMEOUT_S:
                raise ComposeTestError(f"not all healthy after {HEALTHY_TIMEOUT_S} s: {'; '.join(states)}")
            time.sleep(2)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.gateway}/ready", timeout=5):
                    return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ComposeTestError(f"{self.gateway}/ready still fails after 60 s: {exc}") from exc
                time.sleep(1)

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"{self.gateway}{path}", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.load(response)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.gateway}/metrics", timeout=10) as response:
            return response.read().decode()


def decode_tokens(metrics: str) -> dict[str, float]:
    """Output tokens the gateway received from each decode worker, from its llmd_worker_tokens."""
    tokens: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("llmd_worker_tokens_total{"):
            labels, value = line[len("llmd_worker_tokens_total{"):].rsplit("} ", 1)
            worker = dict(pair.split("=", 1) for pair in labels.split(","))["worker_id"].strip('"')
            if worker.startswith("decode-"):
                tokens[worker] = float(value)
    return tokens


def counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(f"{name}{{"))


def worker_host(worker_id: str) -> str:
    # default_worker_id: "<role>-<hostname>-<pid>-<4 hex>"; a container's hostname is its short id.
    return worker_id.split("-", 1)[1].rsplit("-", 2)[0]


def check_stream(lines: list[str], max_tokens: int) -> str:
    """A one-line summary of a streamed completion; raises if any token or the end is missing."""
    chunks = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    usage = next((chunk["usage"] for chunk in reversed(chunks) if chunk.get("usage")), None)
    finish = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"] if choice.get("finish_reason")]
    done = bool(lines) and lines[-1] == "data: [DONE]"
    if usage is None or usage["completion_tokens"] != max_tokens or finish != ["length"] or not done:
        raise ComposeTestError(
            f"the stream did not complete: usage {usage}, finish_reason {finish}, ends with [DONE]: {done}"
        )
    return f"{usage['completion_tokens']} of {max_tokens} tokens, finish_reason length, then [DONE]"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        """Logs nothing: one line per wheel fetched would bury the figures."""


@contextlib.contextmanager
def wheel_index(directory: str | None) -> Iterator[list[str]]:
    """Build arguments that take torch from a local index folder, served on loopback for the build."""
    if not directory:
        yield []
        return
    if not Path(directory, "torch").is_dir():
        raise ComposeTestError(f"TORCH_WHEELS={directory} has no torch/ folder (deploy/offline_images.sh makes one)")
    handler = functools.partial(QuietHandler, directory=directory)
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError as exc:
        where = f"127.0.0.1:{WHEELS_PORT} (TORCH_WHEELS_PORT)"
        raise ComposeTestError(f"cannot serve TORCH_WHEELS on {where}: {exc}") from exc
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # The build shares the host's network to reach the loopback address.
        yield ["--network", "host", "--build-arg", f"TORCH_INDEX_URL=http://127.0.0.1:{WHEELS_PORT}"]
    finally:
        server.shutdown()


def build(engine: str) -> None:
    args = ["--build-arg", f"BASE_IMAGE={os.environ['BASE_IMAGE']}"] if os.environ.get("BASE_IMAGE") else []
    if os.environ.get("COMPOSE_TEST_NO_CACHE") == "1":
        args.append("--no-cache")
    print(f"building {IMAGE} ...", flush=True)
    start = time.monotonic()
    with wheel_index(os.environ.get("TORCH_WHEELS")) as index_args:
        run(engine, "build", *args, *index_args, "-t", IMAGE, ".")
    size = int(run(engine, "image", "inspect", "-f", "{{.Size}}", IMAGE))
    cache = "without" if "--no-cache" in args else "with"
    print(f"build: {time.monotonic() - start:.0f} s ({cache} the layer cache); image {IMAGE}: {size / 1e9:.2f} GB")


def ask(stack: Stack, model: str) -> None:
    prompt = "The capital of France is"
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    print(f"completion: {prompt!r} -> {stack.post('/v1/completions', body)['choices'][0]['text']!r}")
    question = "What is the capital of France? Answer in one sentence."
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 32, "temperature": 0}
    answer = stack.post("/v1/chat/completions", body)["choices"][0]["message"]["content"]
    print(f"chat: {question!r} -> {answer!r}")


def shares(before: dict[str, float], after: dict[str, float], names: dict[str, str]) -> str:
    """Each decode container's share of the tokens between two decode_tokens(), those that served none included."""
    served = dict.fromkeys(sorted(name for name in names.values() if "decode" in name), 0.0)
    for worker, tokens in after.items():
        name = names.get(worker_host(worker), worker)
        served[name] = served.get(name, 0.0) + tokens - before.get(worker, 0.0)
    total = sum(served.values()) or 1.0
    return ", ".join(f"{name} {n / total:.0%} ({n:.0f} tokens)" for name, n in served.items())


def send(stack: Stack, model: str, requests: int, apart_s: float) -> None:
    """`requests` completions started `apart_s` apart, all in flight together."""
    def one(i: int) -> None:
        time.sleep(i * apart_s)
        stack.post("/v1/completions", {"model": model, "prompt": f"Request {i}: a short story about the number {i}.",
                                       "max_tokens": 32, "ignore_eos": True})

    with ThreadPoolExecutor(requests) as pool:
        list(pool.map(one, range(requests)))


def kill_mid_stream(stack: Stack, model: str) -> None:
    lines: list[str] = []
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"{stack.gateway}/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})

    def read() -> None:
        with urllib.request.urlopen(request, timeout=300) as response:
            lines.extend(line.decode().strip() for line in response if line.strip())

    reader = threading.Thread(target=read)
    migrations = counter(stack.metrics(), "llmd_migrations_total")
    reader.start()
    deadline = time.monotonic() + 120
    while sum(line.startswith("data: {") for line in lines) < KILL_AFTER_CHUNKS:
        if time.monotonic() > deadline or not reader.is_alive():
            raise ComposeTestError(f"the stream brought {len(lines)} lines, not {KILL_AFTER_CHUNKS} chunks")
        time.sleep(0.1)
    # The one decode worker whose count grows now is the one serving the stream; on a loaded host
    # a second can pass without a token.
    before, serving = decode_tokens(stack.metrics()), []
    for _ in range(30):
        time.sleep(0.5)
        after = decode_tokens(stack.metrics())
        serving = [worker for worker in after if after[worker] > before.get(worker, 0.0)]
        if serving:
            break
    if len(serving) != 1:
        raise ComposeTestError(f"expected one decode worker serving the stream, found {serving}")
    victim = stack.containers()[worker_host(serving[0])]
    streamed = sum(line.startswith("data: {") for line in lines)
    run(stack.engine, "kill", victim)
    reader.join(timeout=300)
    summary = check_stream(lines, STREAM_TOKENS)
    migrated = counter(stack.metrics(), "llmd_migrations_total") - migrations
    print(f"killed {victim} after {streamed} streamed chunks; the stream completed: {summary}; "
          f"requests migrated off it: {migrated:.0f}")


def main() -> int:
    engine = os.environ.get("CONTAINER_ENGINE", "docker")
    compose = shlex.split(os.environ.get("COMPOSE", f"{engine} compose"))
    port = int(os.environ.get("GATEWAY_PUBLISHED_PORT", "8000"))
    for name, command in (("CONTAINER_ENGINE", engine), ("COMPOSE", compose[0])):
        if shutil.which(command) is None:
            print(f"compose-test: {name} names '{command}', which is not installed", file=sys.stderr)
            return 1
    os.environ.setdefault("DOCKER_BUILDKIT", "1")  # the Dockerfile's cache mounts need BuildKit
    # Equal KV pools (512 MiB): a prefill worker hands each request to the decode worker with the
    # most free blocks, and pools sized from the memory free at each start differ by hundreds of
    # blocks, so under light load the largest would take every request and show no sharing.
    os.environ.setdefault("LLMD_KV_CACHE__MEMORY_BYTES", str(512 << 20))
    stack = Stack(engine, compose, port)
    start = time.monotonic()
    try:
        build(engine)
        stack.compose("up", "-d", "--no-build")
        healthy = stack.wait_healthy()
        stack.wait_ready()
        print(f"healthy: {healthy:.0f} s after `up` ({', '.join(sorted(stack.containers().values()))})")
        model = json.load(urllib.request.urlopen(f"{stack.gateway}/v1/models", timeout=10))["data"][0]["id"]
        ask(stack, model)
        stack.compose("up", "-d", "--no-build", "--scale", "decode=2")
        print(f"scaled decode to 2: healthy after {stack.wait_healthy():.0f} s")
        stack.wait_ready()
        # Names now: a killed container no longer answers `compose ps`.
        names, scaled = stack.containers(), decode_tokens(stack.metrics())
        send(stack, model, requests=8, apart_s=0.0)
        burst = decode_tokens(stack.metrics())
        print(f"a burst of 8 requests, per decode worker: {shares(scaled, burst, names)}")
        send(stack, model, requests=8, apart_s=1.0)
        print(f"8 requests 1 s apart, per decode worker: {shares(burst, decode_tokens(stack.metrics()), names)}")
        kill_mid_stream(stack, model)
        print(f"since scaling, per decode worker: {shares(scaled, decode_tokens(stack.metrics()), names)}")
    except (ComposeTestError, OSError) as exc:  # OSError: a request to the gateway failed
        print(f"compose-test failed: {exc}", file=sys.stderr)
        with contextlib.suppress(ComposeTestError):
            print(stack.compose("logs", "--tail", "40"), file=sys.stderr)
        return 1
    finally:
        stack.compose("down", "--volumes", "--remove-orphans")
    print(f"compose-test passed in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
