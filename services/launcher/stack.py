"""`Stack`: Redis (unless REDIS_URL is set), a gateway and prefill, decode or colocated workers as
subprocesses of one machine, which can add, drain and stop workers while it runs; for the CLI
(cli.py), tests and scripts. Every child gets LLMD_REDIS__URL and a unique LLMD_WORKER__WORKER_ID."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import redis
from pydantic import TypeAdapter

from kernels.disk_cache import cache_dir
from services.launcher.redis_server import (
    RedisServer,
    StackError,
    die_with_parent,
    terminate,
)
from shared.settings import (
    ModelSettings,
    RedisSettings,
    WorkerSettings,
    unknown_settings,
    warn_unknown_settings,
)
from shared.streams import Keys

logger = logging.getLogger("launcher")

ROLES = ("prefill", "decode", "colocated")
STILL_STARTING_EVERY_S = 15.0


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
            terminate(processes, self.config.stop_timeout_s)
        self.children.clear()
        if self._redis_server is not None:
            self._redis_server.stop()
            self._redis_server = None

    def process_ids(self) -> dict[str, int]:
        """Each running child's pid by name, and the private Redis's as "redis-server" (none with a
        shared one): what a benchmark reads CPU time from."""
        pids = {name: c.process.pid for name, c in self.children.items() if c.process.poll() is None}
        redis_pid = self._redis_server.pid if self._redis_server is not None else None
        return pids | ({"redis-server": redis_pid} if redis_pid is not None else {})

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
            pass_fds=pass_fds, preexec_fn=die_with_parent,  # noqa: PLW1509
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
