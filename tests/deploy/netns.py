"""Hosts for tests, as network namespaces on this machine: each its own network stack with one link
to a bridge (in a namespace of its own), addresses 10.77.0.N/24 that exist inside the namespaces
only, so no traffic leaves the machine and nothing in the root namespace changes. Processes run
with a mount namespace and a /dev/shm of their own per host, and a cache folder per host.

    with Hosts("t1", ["gw", "prefill", "decode-a"], delayed="prefill", cache=warm) as hosts:
        hosts.spawn("prefill", ["python", "-m", "services.prefill"], env)
        hosts.link("decode-a", up=False)   # a pulled cable
        hosts.delay("prefill", 50)         # ms on the host's egress, as netem would add
        hosts.executor("gw").submit(...)   # runs in the gw host's network

Everything made is removed on exit, failures included: processes, namespaces (their veths and
the bridge go with them), the delayed host's relay (its TAPs go with it), the per-host folders.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

SUBNET = "10.77.0"
MTU = "9000"  # large frames: fewer for the relay to copy
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)
# a host's processes: their own mount namespace, where a fresh tmpfs hides the machine's /dev/shm
OWN_SHM = ["unshare", "-m", "--propagation", "private", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]


class NetnsUnavailable(RuntimeError):
    """This machine cannot make the namespaces (not root, no iproute2, no unshare...)."""


@dataclass(slots=True)
class Host:
    name: str
    netns: str
    address: str
    link: str  # the bridge's end of its link: down is a pulled cable
    root: Path  # its own folders (cache)


def _die_with_parent() -> None:
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {result.stderr.strip()}")


class Hosts:
    def __init__(self, tag: str, names: Sequence[str], delayed: str | None = None, cache: Path | None = None) -> None:
        """`tag` keeps the namespaces apart from other runs'; `delayed`: the host whose link goes through
        tap_relay, so that `delay` works; `cache`: a warm cache folder each host gets a copy of, as
        $XDG_CACHE_HOME/<its name>."""
        self.tag = tag
        self.bridge_ns = f"llmd-{tag}-br"
        self.hosts = {
            name: Host(name, f"llmd-{tag}-{name}", f"{SUBNET}.{i}", f"l{tag}{i}", Path())
            for i, name in enumerate(names, start=1)
        }
        self._delayed, self._cache = delayed, cache
        self._relay: subprocess.Popen[str] | None = None
        self._processes: list[subprocess.Popen[bytes]] = []
        self._made: list[str] = []
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._dir: Path | None = None  # the hosts' folders, beside `cache` so that hard links reach it

    def __enter__(self) -> Self:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _create(self) -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        for tool in ("ip", "unshare"):
            if shutil.which(tool) is None:
                raise NetnsUnavailable(f"no {tool} on the PATH")
        parent = self._cache.parent if self._cache else None
        self._dir = Path(tempfile.mkdtemp(prefix=f"llmd-hosts-{self.tag}-", dir=parent))
        self._add_netns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "mtu", MTU, "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for host in self.hosts.values():
            self._add_netns(host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            if host.name == self._delayed:
                self._relay_link(host)
            else:
                self._veth_link(host)
            _ip("-n", host.netns, "link", "set", "eth0", "mtu", MTU)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", self.bridge_ns, "link", "set", host.link, "mtu", MTU, "master", "br0", "up")
            host.root = self._dir / host.name
            host.root.mkdir()
            (host.root / "cache").mkdir()
            if self._cache is not None:  # hard links: a copy in a moment, and entries are replaced by rename
                copy = host.root / "cache" / self._cache.name
                subprocess.run(["cp", "-al", str(self._cache), str(copy)], check=True, timeout=60)
        # the unshare this depends on, tried once here rather than failing in every process
        probe = subprocess.run(["ip", "netns", "exec", self.bridge_ns, *OWN_SHM, "true"], capture_output=True,
                               text=True, timeout=30)
        if probe.returncode != 0:
            raise NetnsUnavailable(f"a private /dev/shm (unshare -m) failed: {probe.stderr.strip()}")

    def _add_netns(self, name: str) -> None:
        if Path(f"/run/netns/{name}").exists():  # left by a run of this tag that was killed before its cleanup
            _ip("netns", "del", name)
        _ip("netns", "add", name)
        self._made.append(name)

    def _veth_link(self, host: Host) -> None:
        _ip("link", "add", host.link, "netns", self.bridge_ns, "type", "veth",
            "peer", "name", "eth0", "netns", host.netns)

    def _relay_link(self, host: Host) -> None:
        """The host's link as two TAPs and a relay between them, which can delay what the host sends."""
        host_tap = f"{host.link}h"
        self._relay = subprocess.Popen(
            [sys.executable, "-m", "tests.deploy.tap_relay", host_tap, host.link], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2], preexec_fn=_die_with_parent,  # noqa: PLW1509
        )  # fmt: skip
        assert self._relay.stdout is not None
        if self._relay.stdout.readline().strip() != "ready":
            raise NetnsUnavailable(f"tap_relay did not start (exit {self._relay.wait(10)})")
        _ip("link", "set", host.link, "netns", self.bridge_ns)
        _ip("link", "set", host_tap, "netns", host.netns)
        _ip("-n", host.netns, "link", "set", host_tap, "name", "eth0")

    # -- using them ---------------------------------------------------------------------------

    def address(self, name: str) -> str:
        return self.hosts[name].address

    def root(self, name: str) -> Path:
        return self.hosts[name].root

    def spawn(self, name: str, argv: list[str], env: dict[str, str], stdout: IO[bytes] | None = None,
              cwd: str | None = None) -> subprocess.Popen[bytes]:
        """Run `argv` on host `name`: in its network, with its own /dev/shm; XDG_CACHE_HOME is its cache."""
        host = self.hosts[name]
        host_env = {**env, "XDG_CACHE_HOME": str(host.root / "cache")}
        process = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, *OWN_SHM, *argv], env=host_env, cwd=cwd, stdout=stdout,
            stderr=subprocess.STDOUT if stdout else None, start_new_session=True, preexec_fn=_die_with_parent,  # noqa: PLW1509
        )  # fmt: skip
        self._processes.append(process)
        return process

    def link(self, name: str, up: bool) -> None:
        """Take the host's link down or up at the bridge's end: the host sees its carrier go, as if unplugged."""
        _ip("-n", self.bridge_ns, "link", "set", self.hosts[name].link, "up" if up else "down")

    def received_bytes(self, name: str) -> int:
        """Bytes host `name` has received over its link (its eth0's rx_bytes)."""
        read = ["ip", "netns", "exec", self.hosts[name].netns, "cat", "/sys/class/net/eth0/statistics/rx_bytes"]
        return int(subprocess.run(read, capture_output=True, text=True, check=True, timeout=30).stdout)

    def delay(self, name: str, ms: float) -> None:
        """Hold what host `name` sends for `ms` (only the host made with `delayed=name`)."""
        if name != self._delayed or self._relay is None or self._relay.stdin is None:
            raise ValueError(f"{name} was not made with a delayable link")
        self._relay.stdin.write(f"{ms}\n")
        self._relay.stdin.flush()

    def executor(self, name: str, threads: int = 4) -> ThreadPoolExecutor:
        """Threads in host `name`'s network (a network namespace is per thread): sockets they open are
        that host's. Open clients (HTTP, Redis) on these threads only."""
        if name not in self._executors:
            self._executors[name] = ThreadPoolExecutor(threads, thread_name_prefix=f"netns-{name}",
                                                       initializer=self._enter, initargs=(self.hosts[name].netns,))
        return self._executors[name]

    @staticmethod
    def _enter(netns: str) -> None:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if _LIBC.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
        finally:
            os.close(fd)

    # -- cleaning up --------------------------------------------------------------------------

    def close(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
        for process in self._processes:
            _stop(process)
        if self._relay is not None:
            self._relay.kill()
            self._relay.communicate()  # and closes its pipes
            self._relay = None
        for name in reversed(self._made):  # a namespace takes its veth ends, and with them their peers
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _stop(process: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM the process's group, SIGKILL it after `grace_s`."""
    if process.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
