"""A KV pool smaller than the model's context bounds each request: one that outgrows the whole pool
ends at its size ("length") instead of being preempted and then waiting forever for room."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine, InvalidRequestError
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.model.runner import kv_block_bytes
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings

NUM_BLOCKS = 4  # of 16 tokens: the pool holds 64


@pytest.fixture(scope="module")
def engine(loaded_model: LoadedModel) -> Engine:
    return Engine(EngineSettings(
        model=ModelSettings(dtype="float32", device="cpu"),
        kv_cache=KVCacheSettings(memory_bytes=NUM_BLOCKS * kv_block_bytes(loaded_model.config, 16, torch.float32)),
    ), loaded_model)


def test_a_request_that_outgrows_the_pool_ends_at_its_size(engine: Engine) -> None:
    assert engine.max_model_len == NUM_BLOCKS * 16 < engine.config.max_position_embeddings
    engine.add_request("long", list(range(100, 110)), SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    finish_reason = None
    for _ in range(100):  # the pool ends it after 54 steps; the bound only stops a loop that never would
        for out in engine.step():
            tokens += out.new_token_ids
            finish_reason = out.finish_reason if out.is_finished else None
        if not engine.has_unfinished:
            break
    assert (len(tokens), finish_reason) == (NUM_BLOCKS * 16 - 10, "length")
    assert engine.stats().num_preemptions == 0


def test_a_prompt_the_pool_cannot_hold_is_refused_naming_the_pool(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="this worker's KV cache holds 64 tokens, so prompts may have at most 63"):
        engine.add_request("too-long", list(range(100, 164)), SamplingParams(max_tokens=1))
