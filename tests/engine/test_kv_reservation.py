"""The max_length KV reservation on the real model: the same greedy tokens as paging, without preemptions."""

from __future__ import annotations

import random

import torch

from shared.engine.engine import Engine
from shared.model.loader import LoadedModel
from shared.model.runner import kv_block_bytes
from shared.settings import EngineSettings, KVCacheSettings, KVReservation, ModelSettings, SchedulerSettings
from tests.engine.test_engine_parity import MAX_NEW_TOKENS, run_to_completion

NUM_BLOCKS = 5  # of 16 tokens; each request's prompt takes 2 and its whole length 3


def make_engine(loaded: LoadedModel, reservation: KVReservation) -> Engine:
    return Engine(EngineSettings(
        model=ModelSettings(dtype="float32", device="cpu"),
        kv_cache=KVCacheSettings(memory_bytes=NUM_BLOCKS * kv_block_bytes(loaded.config, 16, torch.float32)),
        scheduler=SchedulerSettings(kv_reservation=reservation),
    ), loaded)


def test_greedy_outputs_are_equal_under_both_reservations(loaded_model: LoadedModel) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, loaded_model.config.vocab_size) for _ in range(n)] for n in (20, 24)]
    assert all(-(-(len(p) + MAX_NEW_TOKENS) // 16) == 3 for p in prompts)
    outputs, preemptions = {}, {}
    for reservation in ("paged", "max_length"):
        engine = make_engine(loaded_model, reservation)
        outputs[reservation] = run_to_completion(engine, prompts)
        preemptions[reservation] = engine.stats().num_preemptions
        assert engine.kv_cache.pool.num_used_blocks == 0
    assert outputs["paged"] == outputs["max_length"]
    # paging starts both, whose growth then overflows the pool; reserving starts one at a time
    assert preemptions["max_length"] == 0 < preemptions["paged"]
