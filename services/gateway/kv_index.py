"""Which prefix blocks each worker caches, mirrored from the workers' KVEvents and KVSnapshots.

Per worker: the set of its cached block hashes, and the (epoch, seq) of the last message
applied. Events apply only in order; one that does not follow (a gap: events trimmed or lost, a
reader that started late, a worker restarted under a new epoch) marks the worker stale and is
kept until a snapshot at or after its predecessor arrives, which the index rebuilds from. A
stale worker still answers lookups from what it had: a stale view costs cache hits, never a
wrong answer, since a worker recomputes whatever it does not find.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.protocol import KVEvents, KVSnapshot

MAX_HELD_EVENTS = 256  # per stale worker: a longer wait for its snapshot starts over from the next one


@dataclass(slots=True)
class WorkerCache:
    worker_id: str
    role: str
    block_size: int
    epoch: str = ""
    seq: int = 0
    block_hashes: set[bytes] = field(default_factory=set)
    is_stale: bool = True  # no snapshot yet, or a gap since: waiting for a snapshot
    held: list[KVEvents] = field(default_factory=list)  # events after the gap, replayed onto the snapshot

    def apply(self, msg: KVEvents) -> None:
        self.block_hashes.difference_update(msg.removed)
        self.block_hashes.update(msg.stored)
        self.seq = msg.seq


class KVIndex:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerCache] = {}

    def on_events(self, msg: KVEvents) -> None:
        cache = self._cache(msg.worker_id, msg.role, msg.block_size)
        if msg.seq == 1 and msg.epoch != cache.epoch:
            # a worker's first events of a life: its pool started empty, so they are its whole cache
            cache.epoch, cache.seq, cache.block_hashes, cache.held, cache.is_stale = msg.epoch, 0, set(), [], False
        if not cache.is_stale and msg.epoch == cache.epoch and msg.seq == cache.seq + 1:
            cache.apply(msg)
            return
        if msg.epoch == cache.epoch and msg.seq <= cache.seq:
            return  # already in (a snapshot covered it)
        cache.is_stale = True
        cache.held = [e for e in cache.held if e.epoch == msg.epoch][-MAX_HELD_EVENTS + 1 :] + [msg]
        # a gap is not forgotten: apply what is known so lookups lean on the freshest guess
        cache.block_hashes.difference_update(msg.removed)
        cache.block_hashes.update(msg.stored)

    def on_snapshot(self, snap: KVSnapshot) -> bool:
        """Rebuild a worker from its snapshot; False when the snapshot is older than events already held
        cover (a later snapshot is needed) or older than what the index has."""
        cache = self._cache(snap.worker_id, snap.role, snap.block_size)
        if not cache.is_stale and snap.epoch == cache.epoch and snap.seq <= cache.seq:
            return True
        held = sorted((e for e in cache.held if e.epoch == snap.epoch and e.seq > snap.seq), key=lambda e: e.seq)
        expected = snap.seq + 1
        for event in held:
            if event.seq != expected:
                return False  # events between the snapshot and the held ones are lost: wait for a later one
            expected += 1
        cache.epoch, cache.seq = snap.epoch, snap.seq
        cache.block_hashes = set(snap.block_hashes)
        for event in held:
            cache.apply(event)
        cache.held, cache.is_stale = [], False
        return True

    def forget(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def clear(self) -> None:
        self.workers.clear()

    @property
    def stale_workers(self) -> list[str]:
        return [w.worker_id for w in self.workers.values() if w.is_stale]

    def num_matched_blocks(self, worker_id: str, block_hashes: Sequence[bytes]) -> int:
        """Length in blocks of the longest prefix of `block_hashes` the worker caches (chained hashes:
        a block's hash is found only where its whole prefix was)."""
        cache = self.workers.get(worker_id)
        if cache is None:
            return 0
        num = 0
        for block_hash in block_hashes:
            if block_hash not in cache.block_hashes:
                break
            num += 1
        return num

    def _cache(self, worker_id: str, role: str, block_size: int) -> WorkerCache:
        cache = self.workers.get(worker_id)
        if cache is None or cache.block_size != block_size:
            cache = self.workers[worker_id] = WorkerCache(worker_id, role, block_size)
        return cache
