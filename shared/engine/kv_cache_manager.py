"""Per-request block tables on top of the block pool, with prefix sharing.

      token positions    0 ........ 15 | 16 ....... 31 | 32 .. 37
      block_table[req] = [  block 7     ,   block 2     ,  block 9  ]
      block hashes       h0 = H(-, t0..15), h1 = H(h0, t16..31), (partial: none)

Blocks are taken as a request grows; only when the scheduler asks for a reservation (its
max_length policy) are they taken up front. Only full blocks are hashed and shared, so a
request only ever writes into blocks it owns alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.block_pool import Block, BlockHash, BlockPool, extend_block_hashes
from shared.engine.request import ReqId, Request


@dataclass(slots=True)
class KVCacheStats:
    num_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_free_blocks: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found
    live_token_slots: int
    allocated_token_slots: int

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def utilization(self) -> float:
        """Slots holding live tokens / slots allocated to requests."""
        return self.live_token_slots / self.allocated_token_slots if self.allocated_token_slots else 1.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._req_blocks: dict[ReqId, list[Block]] = {}
        # the same blocks' ids, kept beside them: every step reads each running request's table
        self._req_block_ids: dict[ReqId, list[int]] = {}
        self._req_hashes: dict[ReqId, list[BlockHash]] = {}
        self._num_cached_blocks: dict[ReqId, int] = {}
        self._req_num_tokens: dict[ReqId, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    def block_hashes(self, req: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended as its tokens grow."""
        return extend_block_hashes(self._req_hashes.setdefault(req.req_id, []), req.token_ids, self.block_size)

    def find_cached_prefix(self, req: Request) -> list[Block]:
        """Cached blocks for the longest prefix of the request, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in self.block_hashes(req)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_blocks_needed(
        self, req: Request, num_new_tokens: int, num_cached_blocks: int = 0, num_reserved_tokens: int = 0
    ) -> int:
        held = len(self._req_blocks.get(req.req_id, ())) + num_cached_blocks
        num_computed = max(req.num_computed_tokens, num_cached_blocks * self.block_size)
        total = -(-max(num_computed + num_new_tokens, num_reserved_tokens) // self.block_size)
        return max(0, total - held)

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        cached_blocks: list[Block] | None = None,
        num_reserved_tokens: int = 0,
    ) -> bool:
        """Grow the request's blocks to hold `num_new_tokens` more; False (and no change) if they don't fit.

        `cached_blocks` are prefix hits from `find_cached_prefix`, taken on the first allocation.
        `num_reserved_tokens`: hold blocks for at least this many tokens, whatever is computed yet.
        """
        cached_blocks = cached_blocks or []
        num_new_blocks = self.num_blocks_needed(req, num_new_tokens, len(cached_blocks), num_reserved_tokens)
        num_revived = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return False
        blocks = self._req_blocks.setdefault(req.req_id, [])
        num_held = len(blocks)
        if cached_blocks:
            self.pool.touch(cached_blocks)
            blocks.extend(cached_blocks)
            self._num_cached_blocks[req.req_id] = len(cached_blocks)
        blocks.extend(self.pool.allocate(num_new_blocks))
        self._req_block_ids.setdefault(req.req_id, []).extend(b.block_id for b in blocks[num_held:])
        self._req_num_tokens[req.req_id] = max(req.num_computed_tokens, len(cached_blocks) * self.block_size) + num_new_tokens
        return True

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's newly completed full blocks under their content hashes."""
        if not self.enable_prefix_caching:
            return
        blocks = self._req_blocks[req.req_id]
        num_full = min(req.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(req.req_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(req)
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self._num_cached_blocks[req.req_id] = num_full

    def free(self, req: Request) -> None:
        blocks = self._req_blocks.pop(req.req_id, [])
        self._req_block_ids.pop(req.req_id, None)
        # free in reverse so a request's tail blocks are evicted before the prefix others may share
        self.pool.free(reversed(blocks))
        self._req_hashes.pop(req.req_id, None)
        self._num_cached_blocks.pop(req.req_id, None)
        self._req_num_tokens.pop(req.req_id, None)

    def block_ids(self, req_id: ReqId) -> list[int]:
        """The request's block table, as kept here: read it, never change it."""
        return self._req_block_ids.get(req_id, [])

    def blocks(self, req_id: ReqId) -> list[Block]:
        return self._req_blocks.get(req_id, [])

    def ref_counts_from_tables(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for blocks in self._req_blocks.values():
            for block in blocks:
                counts[block.block_id] = counts.get(block.block_id, 0) + 1
        return counts

    def check_invariants(self) -> None:
        self.pool.check_invariants(self.ref_counts_from_tables())
        tables = {req_id: [b.block_id for b in blocks] for req_id, blocks in self._req_blocks.items() if blocks}
        kept = {req_id: ids for req_id, ids in self._req_block_ids.items() if ids}
        if kept != tables:
            raise AssertionError(f"block tables by id {kept} differ from the blocks held {tables}")

    def stats(self) -> KVCacheStats:
        allocated = sum(len(b) for b in self._req_blocks.values()) * self.block_size
        return KVCacheStats(
            num_blocks=self.pool.num_blocks,
            num_used_blocks=self.pool.num_used_blocks,
            num_cached_blocks=self.pool.num_cached_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            live_token_slots=sum(self._req_num_tokens.values()),
            allocated_token_slots=allocated,
        )
