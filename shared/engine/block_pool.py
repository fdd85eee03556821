"""Fixed-size KV blocks: reference counts, content hashes and least-recently-used eviction.

A block is in exactly one of three states:
  in use    ref_cnt > 0, held by one or more requests' block tables;
  cached    ref_cnt == 0 and block_hash set: in the free queue, but a prefix hit revives it;
  empty     ref_cnt == 0 and no hash: in the free queue.
The free queue is ordered by eviction priority: allocation takes from its front.

Every change of the cached set (a hash stored, a hash evicted) goes to `on_event`, in order, so
that a router elsewhere can mirror which prefixes this pool holds (services/runtime/kv_events.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
# (block_hash, stored): True when the hash became findable here, False when it was evicted
BlockEventSink = Callable[[BlockHash, bool], None]


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Content address of a full block, chained over its parent so equal blocks mean equal prefixes.

    A stable digest (not Python's hash) so that prefill and decode workers agree on it.
    """
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return BlockHash(digest.digest())


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Append to `hashes` (those of the first full blocks of `token_ids`) the hashes of the full blocks after them."""
    while (len(hashes) + 1) * block_size <= len(token_ids):
        start = len(hashes) * block_size
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start : start + block_size]))
    return hashes


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self.on_event: BlockEventSink | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take (empty or evictable cached)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash a prefix lookup can find now: what a snapshot of `on_event`'s history gives."""
        return list(self._cached)

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[Block]:
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take another reference on cached blocks (a prefix hit), reviving freed ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the eviction queue in the given order."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache(self, block: Block, block_hash: BlockHash) -> None:
        """Make a full block findable by its content; a duplicate of an already cached block stays private."""
        if block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self.on_event is not None:
            self.on_event(block_hash, True)

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self.on_event is not None:
                self.on_event(block.block_hash, False)
            block.block_hash = None

    def check_invariants(self, expected_ref_counts: dict[int, int]) -> None:
        """Assert that reference counts equal block-table usage and no block leaked."""
        for block in self.blocks:
            expected = expected_ref_counts.get(block.block_id, 0)
            assert block.ref_cnt == expected, f"block {block.block_id}: ref_cnt {block.ref_cnt} != {expected} uses"
            assert (block.ref_cnt == 0) == (block.block_id in self._free), f"block {block.block_id} free-queue state"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"block {block.block_id} cached under a stale hash"
