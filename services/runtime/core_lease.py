"""Lends a host's idle cores between the CPU workers that share them, through a lease on a tmpfs.

Workers that share a host's cores (`make run`, one compose stack) otherwise choose between two
losses: a fixed share of the cores leaves the decode worker on one core for the long tail of a
burst after prefill went quiet, and a full set oversubscribes while both are busy, where an
OpenMP team with one thread descheduled stalls at every barrier (steps of a second and more).

So each worker publishes, in a small file of a ledger that every worker on these CPUs maps, how
many threads it runs and whether it has work. A worker with work may run its fair share of the
cores (the cores over the number of workers with work, at least one) and, beyond that, whatever
no one else holds. A worker that gets work while a neighbour runs on its share waits, before its
step, until the neighbour gives the share back; the neighbour looks between its decoder layers,
so the wait is at most one layer. Threads change only at a step or a layer boundary, never while
an OpenMP team is running, and grow only into cores no one holds, so the workers' threads never
add up to more than the cores (unless more workers have work than there are cores).

A worker may also lend its cores while it still has work (`lend`): a decode worker ahead of its
inter-token target does, between its steps, so that a neighbour's prefill runs on every core until
the next token is due (services/runtime/engine_thread.py paces it). The borrower grows at its next layer.

Each worker holds an exclusive flock on its own file for its life; the kernel drops it when the
process dies, however it dies, so a dead worker's threads stop counting at once. Updates go
under a second flock, on the ledger's guard file; the check between layers only reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# a worker's file: the threads it runs now, and 1 while it has work (0 when idle)
SLOT = struct.Struct("<qq")
GUARD_NAME = "guard"


def cpu_list_text(cpus: set[int]) -> str:
    """'0-3,6' for {0, 1, 2, 3, 6}: the ledger's name, so workers pinned to other CPUs keep their own."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and int(ranges[-1].rpartition("-")[2]) == cpu - 1:
            ranges[-1] = f"{ranges[-1].partition('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


@dataclass
class _Peer:
    fd: int
    view: mmap.mmap

    def read(self) -> tuple[int, bool]:
        threads, has_work = SLOT.unpack_from(self.view)
        return threads, bool(has_work)

    def close(self) -> None:
        self.view.close()
        os.close(self.fd)


class CoreLease:
    """One worker's part in its host's core ledger. On the engine thread: `before_step()` before
    each engine step (it may wait for a neighbour to give cores back), `rebalance()` from the
    model's layer loop (between layers and within them), `after_call(has_work)` after each engine call, `lend()` between steps;
    `leave()` when the worker stops. `neighbour_has_work()` may be asked from any thread."""

    def __init__(
        self,
        directory: str,
        max_threads: int,
        cpus: set[int] | None = None,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        wait_timeout_s: float = 2.0,
        poll_s: float = 0.0005,
    ) -> None:
        self.cpus = cpus if cpus is not None else os.sched_getaffinity(0)
        self.num_cores = len(self.cpus)
        self.max_threads = max(1, min(max_threads, self.num_cores))
        self.threads = 0  # held now; 0 while idle
        self.step_cap = self.max_threads  # the most this step takes (services/runtime/step_threads.py)
        self.has_work = False
        self._set_threads = set_threads
        self._torch_threads: int | None = None
        self._wait_timeout_s = wait_timeout_s
        self._poll_s = poll_s
        self.ledger = Path(directory) / f"llmd-cores-{cpu_list_text(self.cpus)}"
        self.ledger.mkdir(parents=True, exist_ok=True)
        self._guard = os.open(self.ledger / GUARD_NAME, os.O_RDWR | os.O_CREAT, 0o666)
        self.name = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._peers: dict[str, _Peer] = {}
        # the flock excludes other processes only; this also keeps `_peers` whole for other threads
        self._lock = threading.Lock()
        with self._guarded():  # created and locked at once: no one may take it for a dead worker's
            fd = os.open(self.ledger / self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, SLOT.size)
            self._own = _Peer(fd, mmap.mmap(fd, SLOT.size))
        logger.info("core lease %s: up to %d of %d cores (%s)", self.ledger, self.max_threads, self.num_cores,
                    cpu_list_text(self.cpus))  # fmt: skip

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        with self._lock:
            fcntl.flock(self._guard, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._guard, fcntl.LOCK_UN)

    def _publish(self, threads: int, has_work: bool) -> None:
        SLOT.pack_into(self._own.view, 0, threads, int(has_work))
        self.threads, self.has_work = threads, has_work

    def _use(self, threads: int) -> None:
        if threads != self._torch_threads:
            self._set_threads(threads)
            self._torch_threads = threads

    def _live_peers(self) -> list[tuple[int, bool]]:
        """The other workers' (threads, has work), under the guard; a dead one's file is removed."""
        names = {e.name for e in os.scandir(self.ledger)} - {GUARD_NAME, self.name}
        for gone in self._peers.keys() - names:
            self._peers.pop(gone).close()
        states = []
        for name in names:
            peer = self._peers.get(name)
            if peer is None:
                try:
                    fd = os.open(self.ledger / name, os.O_RDONLY)
                except FileNotFoundError:
                    continue
                peer = self._peers[name] = _Peer(fd, mmap.mmap(fd, SLOT.size, access=mmap.ACCESS_READ))
            try:
                fcntl.flock(peer.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                states.append(peer.read())  # its owner holds the lock: alive
                continue
            logger.info("core lease: worker %s is gone; its cores are free", name)
            (self.ledger / name).unlink(missing_ok=True)
            self._peers.pop(name).close()
        return states

    def fair_share(self, num_with_work: int) -> int:
        return max(1, self.num_cores // max(1, num_with_work))

    def _wanted(self, peers: list[tuple[int, bool]]) -> tuple[int, int, int]:
        """(threads this worker may want, cores free of everyone else's claims, its fair share)."""
        fair = self.fair_share(1 + sum(has_work for _, has_work in peers))
        # a neighbour with work has its fair share set aside even while it waits for it
        free = self.num_cores - sum(max(threads, fair) if has_work else threads for threads, has_work in peers)
        return min(self.step_cap, max(fair, free)), free, fair

    def before_step(self, cap: int | None = None) -> int:
        """Take this step's threads: the fair share at least, more where no one else holds them, and
        never more than `cap` (the lease's most where None) until the next step. Waits while a
        neighbour runs on more than its fair share and too little is free (it gives the surplus back
        at its next layer), at most `wait_timeout_s`."""
        self.step_cap = self.max_threads if cap is None else max(1, min(cap, self.max_threads))
        deadline = time.monotonic() + self._wait_timeout_s
        while True:
            with self._guarded():
                peers = self._live_peers()
                wanted, free, fair = self._wanted(peers)
                borrowed = any(threads > fair for threads, has_work in peers)
                timed_out = time.monotonic() > deadline
                if wanted <= free or not borrowed or timed_out:
                    self._publish(wanted, True)
                    break
                self._publish(min(self.threads, max(0, free)), True)  # asks: its neighbours see it has work
            time.sleep(self._poll_s)
        if timed_out:
            logger.warning("core lease: a neighbour kept its borrowed cores past %g s; stepping on %d of %d cores "
                           "anyway", self._wait_timeout_s, wanted, self.num_cores)  # fmt: skip
        self._use(wanted)
        return wanted

    def rebalance(self) -> None:
        """Mid-step: gives cores beyond the fair share back as soon as another worker has work, and takes
        cores that a neighbour lent meanwhile (it went idle, or lends them between its steps)."""
        if not self.threads:  # not within a step
            return
        peers = [peer.read() for peer in self._peers.values()]
        wanted, free, fair = self._wanted(peers)
        if self.threads > fair:
            threads = fair
        elif self.threads < wanted <= free:
            threads = wanted
        else:
            return
        with self._guarded():
            if threads > self.threads:  # read again under the guard: a neighbour may have claimed them since
                threads = max(self.threads, min(threads, self._wanted(self._live_peers())[1]))
            self._publish(threads, True)
        self._use(threads)

    @contextlib.contextmanager
    def loading(self) -> Iterator[int]:
        """Threads for work before the first step (loading the model), yielded and set: the fair share
        among every worker on the ledger, busy or not, since a host's workers start together and a
        team that oversubscribes the cores stalls at every barrier (4 s instead of 0.6 s to pack a
        135M model's weights on 2 cores). Held as work, so a serving neighbour gives back its surplus
        at its next layer; lent afterwards."""
        with self._guarded():
            threads = min(self.max_threads, self.fair_share(1 + len(self._live_peers())))
            self._publish(threads, True)
        self._use(threads)
        try:
            yield threads
        finally:
            self.lend()

    def lend(self) -> None:
        """Holds no cores until the next `before_step`, whether or not this worker still has work:
        its neighbours take them at their next layer."""
        if self.threads or self.has_work:
            with self._guarded():
                self._publish(0, False)

    def neighbour_has_work(self) -> bool:
        """Whether another worker on these cores has work (and so a use for lent cores)."""
        with self._lock:
            return any(peer.read()[1] for peer in self._peers.values())

    def after_call(self, has_work: bool) -> None:
        """An engine left without work holds no cores until its next step."""
        if not has_work:
            self.lend()

    def leave(self) -> None:
        """Takes this worker out of the ledger. Safe while the engine thread still steps: its file's
        mapping and locks stay until `close()` or the process's exit."""
        with self._guarded():
            (self.ledger / self.name).unlink(missing_ok=True)

    def close(self) -> None:
        self.leave()
        self._own.close()
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
        os.close(self._guard)
