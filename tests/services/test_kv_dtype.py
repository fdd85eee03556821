"""A stack whose workers keep their KV cache in 8 bits (int8, a scale per token and kv head), with
real processes, the real model and Redis: the handoff moves the 8-bit blocks with their scales,
a request whose decode worker is SIGKILLed mid-generation is migrated to the other one, and
either way the client gets the text one engine with the same cache dtype produces. A decode
worker that stores another dtype refuses the offer, and the client gets a clear error."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis
from openai import APIError, OpenAI

from kernels.kv_quant import FORMATS
from services.launcher import Stack
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.model.runner import kv_block_bytes
from shared.settings import KVCacheSettings
from tests.services.stacks import FAST_HEARTBEAT, HolderKiller, live_workers, running_stack, streamed_text
from tests.services.test_faults import assert_clean, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KV_DTYPE = "int8"
KV_BYTES = 32 * 2**20
NUM_TOKENS = 24
PROMPT = "The lighthouse keeper climbed the stairs each evening and"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    env = {"LLMD_KV_CACHE__MEMORY_BYTES": str(KV_BYTES), **FAST_HEARTBEAT}
    with running_stack("kv-dtype", env, num_decode=2, kv_cache_dtype=KV_DTYPE) as stack:
        yield stack


@pytest.fixture(scope="module")
def expected() -> str:
    """One engine with the same cache dtype (and the workers' float32 model)."""
    llm = LLM(dtype="float32", kv_cache=KVCacheSettings(dtype=KV_DTYPE, memory_bytes=KV_BYTES))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    return llm.generate([PROMPT], params)[0].text


def streamed(client: OpenAI, model: str, on_chunk: Callable[[int], None] = lambda n: None) -> str:
    return streamed_text(client, model, PROMPT, NUM_TOKENS, on_chunk, temperature=0.0)


def test_the_8_bit_pool_holds_the_blocks_its_bytes_allow(stack: Stack, rds: redis.Redis,
                                                           loaded_model: LoadedModel) -> None:
    block_bytes = kv_block_bytes(loaded_model.config, 16, FORMATS[KV_DTYPE])
    assert {s.total_blocks for s in live_workers(rds, stack.keys, "decode")} == {KV_BYTES // block_bytes}
    assert KV_BYTES // block_bytes > 3 * (KV_BYTES // kv_block_bytes(loaded_model.config, 16, FORMATS["float32"]))


def test_a_handed_off_and_a_migrated_request_finish_with_the_one_engine_text(
    stack: Stack, client: OpenAI, model: str, expected: str, rds: redis.Redis
) -> None:
    assert streamed(client, model) == expected
    assert_clean(rds, stack.keys)
    kill_holder = HolderKiller(stack, rds, "decode")

    # the gateway re-runs the prompt and the tokens already streamed through prefill, whose int8
    # blocks go to the surviving decode worker
    assert streamed(client, model, kill_holder) == expected
    assert len(kill_holder.victims) == 1
    assert_clean(rds, stack.keys)


def test_a_decode_worker_storing_another_dtype_refuses_the_handoff_with_a_clear_error(
    stack: Stack, client: OpenAI, model: str, rds: redis.Redis
) -> None:
    stack.config.role_env["decode"] = {"LLMD_KV_CACHE__DTYPE": "fp8_e4m3"}
    odd = stack.add_worker("decode")
    for name in [n for n, c in stack.children.items() if c.role == "decode" and n != odd]:
        stack.drain_worker(name)
        until(lambda: stack.exited() == {} and name not in stack.children, f"{name} to drain and exit")
    until(lambda: [s.worker_id for s in live_workers(rds, stack.keys, "decode")] == [odd], "only the odd worker left")

    with pytest.raises(APIError, match=f"KV cache dtype mismatch: prefill worker .* stores {KV_DTYPE}, decode "
                                       f"worker {odd} stores fp8_e4m3"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0.0)
    assert_clean(rds, stack.keys)
