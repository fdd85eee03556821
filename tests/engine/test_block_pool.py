from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shared.engine.block_pool import BlockPool, NoFreeBlocksError, hash_block_tokens
from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.request import ReqId, Request
from shared.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_req(req_id: str, token_ids: list[int]) -> Request:
    return Request(ReqId(req_id), token_ids, SamplingParams(), seed=0, eos_token_ids=(), max_model_len=10_000)


def test_allocation_takes_from_front_of_free_queue() -> None:
    pool = BlockPool(4)
    assert [b.block_id for b in pool.allocate(2)] == [0, 1]
    assert pool.num_free_blocks == 2
    with pytest.raises(NoFreeBlocksError, match="asked for 3 blocks, only 2 free"):
        pool.allocate(3)


def test_freed_blocks_are_evicted_in_free_order() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.free([c, a])
    assert [blk.block_id for blk in pool.allocate(2)] == [c.block_id, a.block_id]


def test_cached_block_survives_free_until_evicted() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache(block, h)
    pool.free([block])
    assert pool.lookup(h) is block
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([block])
    pool.allocate(2)  # takes the other block first, then evicts the cached one
    assert pool.lookup(h) is None


def test_hash_chains_over_parent() -> None:
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(h1, [3, 4]) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])


def test_prefix_hit_shares_blocks_while_owner_runs() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    owner = make_req("a", list(range(10)))
    assert kv.allocate_slots(owner, 10)
    owner.num_computed_tokens = 10
    kv.cache_full_blocks(owner)
    follower = make_req("b", list(range(8)) + [99, 98, 97])
    hits = kv.find_cached_prefix(follower)
    assert [b.block_id for b in hits] == kv.block_ids(ReqId("a"))[:2]
    assert kv.allocate_slots(follower, 3, hits)
    assert kv.block_ids(ReqId("b"))[:2] == kv.block_ids(ReqId("a"))[:2]
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids(ReqId("b"))] == [2, 2, 1]
    kv.check_invariants()
    kv.free(owner)
    kv.free(follower)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == 8 and kv.pool.num_cached_blocks == 2


def test_full_prompt_hit_leaves_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    first = make_req("a", list(range(8)))
    kv.allocate_slots(first, 8)
    first.num_computed_tokens = 8
    kv.cache_full_blocks(first)
    again = make_req("b", list(range(8)))
    assert len(kv.find_cached_prefix(again)) == 1


class BlockPoolMachine(RuleBasedStateMachine):
    """Any sequence of allocate / append / share-by-prefix / free / preempt keeps ref counts exact."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}
        self.count = 0

    def _admit(self, token_ids: list[int]) -> None:
        req = make_req(f"r{self.count}", token_ids)
        self.count += 1
        hits = self.kv.find_cached_prefix(req)
        computed = len(hits) * BLOCK_SIZE
        if self.kv.allocate_slots(req, req.num_tokens - computed, hits):
            req.num_computed_tokens = req.num_tokens
            self.kv.cache_full_blocks(req)
            self.live[req.req_id] = req

    @rule(length=st.integers(1, 20), vocab=st.integers(1, 3))
    def allocate(self, length: int, vocab: int) -> None:
        # a tiny vocabulary makes shared prefixes frequent
        self._admit([i % vocab for i in range(length)])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def share_prefix(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.live)))
        prefix = self.live[owner].token_ids[: data.draw(st.integers(1, self.live[owner].num_tokens))]
        self._admit(prefix + data.draw(st.lists(st.integers(0, 5), max_size=6)))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num_new=st.integers(1, 6))
    def append(self, data: st.DataObject, num_new: int) -> None:
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if self.kv.allocate_slots(req, num_new):
            req.token_ids.extend([7] * num_new)
            req.output_token_ids.extend([7] * num_new)
            req.num_computed_tokens += num_new
            self.kv.cache_full_blocks(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_or_preempt(self, data: st.DataObject) -> None:
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(req)
        req.num_computed_tokens = 0

    @invariant()
    def ref_counts_match_tables(self) -> None:
        self.kv.check_invariants()
        used = {bid for req in self.live.values() for bid in self.kv.block_ids(req.req_id)}
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks - len(used)

    def teardown(self) -> None:
        for req in self.live.values():
            self.kv.free(req)
        self.kv.check_invariants()
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
