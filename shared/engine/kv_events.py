"""The block pool's stored/evicted hashes, collected between drains, for whoever mirrors the cache.

No I/O here: a worker drains the log after each engine call and publishes what it got
(services/runtime/kv_events.py). Within one drain only each hash's last change matters: a hash evicted
and stored again is stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.block_pool import BlockHash


@dataclass(slots=True)
class BlockChanges:
    """The net change of a pool's cached hashes over some span."""

    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.stored and not self.removed


class BlockEventLog:
    """A `BlockPool.on_event` sink; one owner thread (the engine's) records and drains."""

    def __init__(self) -> None:
        self._last: dict[BlockHash, bool] = {}  # insertion-ordered: each hash's last change

    def __call__(self, block_hash: BlockHash, stored: bool) -> None:
        self._last.pop(block_hash, None)
        self._last[block_hash] = stored

    def drain(self) -> BlockChanges:
        changes = BlockChanges()
        for block_hash, stored in self._last.items():
            (changes.stored if stored else changes.removed).append(block_hash)
        self._last.clear()
        return changes
