"""The gateway's KV index against the workers' own prefix caches: the engine core's scheduler and
block pool run a random workload; their events, some lost, and snapshots feed the index."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.gateway.kv_index import KVIndex
from services.runtime.kv_events import KVEventSource
from shared.engine.block_pool import extend_block_hashes
from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.request import ReqId, Request
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig, StepResult
from shared.protocol import KVEvents, KVSnapshot, decode, encode

BLOCK_SIZE = 4
WORKERS = ("w0", "w1")


def make_req(req_id: str, token_ids: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(ReqId(req_id), token_ids, params, seed=0, eos_token_ids=(), max_model_len=1000)


class Worker:
    """One worker's engine core: scheduler and KV cache, with its event source attached."""

    def __init__(self, worker_id: str) -> None:
        self.kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=True)
        self.scheduler = Scheduler(SchedulerConfig(16, 4, enable_chunked_prefill=True, kv_reservation="paged"), self.kv)
        self.source = KVEventSource(worker_id, "prefill", BLOCK_SIZE)
        self.source.attach(self.kv.pool)

    def step(self, token: int) -> None:
        batch = self.scheduler.schedule()
        if not batch.is_empty:
            num_sampling = sum(batch.samples(i) for i in range(len(batch.reqs)))
            self.scheduler.update(batch, StepResult(token_ids=[token] * num_sampling))

    def cached(self) -> set[bytes]:
        return set(self.kv.pool.cached_hashes())


class IndexMachine(RuleBasedStateMachine):
    """Whatever runs, is evicted or is lost on the way, the index equals each worker's cache once a
    snapshot followed the losses, and exactly so all along while nothing is lost."""

    def __init__(self) -> None:
        super().__init__()
        self.workers = {w: Worker(w) for w in WORKERS}
        self.index = KVIndex()
        self.lost: set[str] = set()  # workers whose events were lost since their last snapshot
        self.count = 0

    @rule(worker=st.sampled_from(WORKERS), length=st.integers(1, 24), vocab=st.integers(1, 3),
          max_tokens=st.integers(1, 6))
    def add(self, worker: str, length: int, vocab: int, max_tokens: int) -> None:
        # a tiny vocabulary makes shared prefixes (and revived, re-evicted blocks) frequent
        self.workers[worker].scheduler.add(make_req(f"r{self.count}", [i % vocab for i in range(length)], max_tokens))
        self.count += 1

    @rule(worker=st.sampled_from(WORKERS), token=st.integers(0, 2), num_steps=st.integers(1, 4))
    def step(self, worker: str, token: int, num_steps: int) -> None:
        for _ in range(num_steps):
            self.workers[worker].step(token)

    @precondition(lambda self: any(w.scheduler.running or w.scheduler.waiting for w in self.workers.values()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from([w for w in self.workers.values() if w.scheduler.running or w.scheduler.waiting]))
        req = data.draw(st.sampled_from([*worker.scheduler.running, *worker.scheduler.waiting]))
        worker.scheduler.abort(req.req_id)

    @rule(worker=st.sampled_from(WORKERS), lose=st.booleans())
    def publish(self, worker: str, lose: bool) -> None:
        source = self.workers[worker].source
        source.collect()
        while source.ready:
            msg = source.ready.popleft()
            if lose:
                self.lost.add(worker)
            else:
                self.index.on_events(decode(encode(msg)))  # as read off the stream

    @rule(worker=st.sampled_from(WORKERS))
    def snapshot(self, worker: str) -> None:
        w = self.workers[worker]
        held = list(w.source.ready)  # collected but not yet published: after the snapshot on the stream
        w.source.ready.clear()
        snap = w.source.snapshot(w.kv.pool)
        for msg in [*held, *w.source.ready]:
            assert msg.seq <= snap.seq
        w.source.ready.clear()
        assert self.index.on_snapshot(decode(encode(snap)))
        self.lost.discard(worker)

    @invariant()
    def index_mirrors_caches(self) -> None:
        for worker_id, worker in self.workers.items():
            if worker_id in self.lost or worker.source.ready:
                continue
            worker.source.collect()
            for msg in list(worker.source.ready):
                self.index.on_events(msg)
            worker.source.ready.clear()
            if worker_id not in self.index.workers:
                assert not worker.cached()
                continue
            assert self.index.workers[worker_id].block_hashes == worker.cached()
            assert not self.index.workers[worker_id].is_stale

    @invariant()
    def longest_prefix_matches_the_pool(self) -> None:
        for worker_id, worker in self.workers.items():
            if worker_id in self.lost:
                continue
            for req in [*worker.scheduler.running, *worker.scheduler.waiting]:
                hashes = extend_block_hashes([], req.token_ids, BLOCK_SIZE)
                expected = next((i for i, h in enumerate(hashes) if worker.kv.pool.lookup(h) is None), len(hashes))
                assert self.index.num_matched_blocks(worker_id, hashes) == expected


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def test_gap_waits_for_a_snapshot_that_covers_it() -> None:
    index = KVIndex()

    def events(seq: int, stored: list[bytes]) -> KVEvents:
        return KVEvents("w", "prefill", "e1", seq, BLOCK_SIZE, stored, [])

    index.on_events(events(1, [b"a"]))
    index.on_events(events(3, [b"c"]))  # 2 was lost
    assert index.stale_workers == ["w"]
    assert not index.on_snapshot(KVSnapshot("w", "prefill", "e1", 1, BLOCK_SIZE, [b"a"]))  # 2 still missing
    assert index.on_snapshot(KVSnapshot("w", "prefill", "e1", 2, BLOCK_SIZE, [b"a", b"b"]))
    assert index.workers["w"].block_hashes == {b"a", b"b", b"c"} and index.stale_workers == []
    index.on_events(events(4, [b"d"]))
    assert index.workers["w"].seq == 4
