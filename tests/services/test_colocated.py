"""Colocated workers (one engine prefilling in chunks and decoding) as the only workers of a real
stack, through the `openai` client: greedy completions equal the offline engine's, a client that
leaves frees its blocks, a worker killed mid-generation has its request re-run by the other one;
and the `cpus` setting that pins a worker to its cores."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import redis
from openai import OpenAI
from pydantic import ValidationError

from services.launcher import Stack
from services.runtime.cpu_pin import CpuPinError, pin_to_cpus
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.protocol import WorkerStatus
from shared.settings import (
    EngineSettings,
    KVCacheSettings,
    ModelSettings,
    SchedulerSettings,
    WorkerSettings,
)
from shared.streams import PREFILL_GROUP, Keys
from tests.services.stacks import FAST_HEARTBEAT, HolderKiller, live_workers, running_stack, streamed_text
from tests.services.test_e2e import token_texts
from tests.services.test_faults import until

KV_BYTES = 32 * 2**20
BUDGET = 32  # tokens per engine step: the prompts below are prefilled in chunks
# longer than BUDGET, and different in their first 16-token block, so no prefix-cache hit changes numbers
PROMPTS = [
    "Write a short note about lighthouses. " * 4,
    "List three facts about the planet Mars, one per line. " * 3,
]
SEEDED_PROMPT = "Once upon a time, in a village by the sea,"
NUM_SEEDED_TOKENS = 40


# -- the cpus setting ------------------------------------------------------------------------------


def test_cpus_takes_cpu_lists_and_names_a_malformed_one() -> None:
    assert WorkerSettings(cpus="0-2,5").cpus == "0-2,5"
    assert WorkerSettings().cpus == ""
    with pytest.raises(ValidationError, match=r"cpus '0-' is not a CPU list like '0', '0-1' or '0,2'"):
        WorkerSettings(cpus="0-")


def test_pinning_to_cpus_outside_the_available_ones_names_both() -> None:
    available = sorted(os.sched_getaffinity(0))
    outside = available[-1] + 1
    with pytest.raises(CpuPinError, match=rf"cpus '{outside}' names CPUs \[{outside}\] .*available: \[{available[0]}"):
        pin_to_cpus(str(outside))


def test_pinning_moves_every_thread_of_the_process_and_those_started_later() -> None:
    # in a child process: pinning this one would slow the rest of the suite
    cpu = min(os.sched_getaffinity(0))
    script = f"""
import os, threading
from services.runtime.cpu_pin import pin_to_cpus
started = threading.Event()
before = threading.Thread(target=lambda: (started.set(), threading.Event().wait(5)), daemon=True)
before.start(); started.wait()
pin_to_cpus("{cpu}")
later = {{}}
after = threading.Thread(target=lambda: later.update(cpus=os.sched_getaffinity(0)))
after.start(); after.join()
print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(before.native_id)), sorted(later["cpus"]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == f"[{cpu}] [{cpu}] [{cpu}]"


# -- a stack of colocated workers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    env = {
        "LLMD_KV_CACHE__MEMORY_BYTES": str(KV_BYTES), "LLMD_SCHEDULER__MAX_NUM_BATCHED_TOKENS": str(BUDGET),
        "LLMD_TORCH_THREADS": "1", **FAST_HEARTBEAT,
    }  # fmt: skip
    with running_stack("colocated", env, num_prefill=0, num_decode=0, num_colocated=2) as stack:
        yield stack


@pytest.fixture(scope="module")
def llm() -> LLM:
    # what each worker runs: float32, one torch thread, the same step budget (same chunks, same numbers)
    return LLM(settings=EngineSettings(
        model=ModelSettings(dtype="float32"), kv_cache=KVCacheSettings(memory_bytes=KV_BYTES),
        scheduler=SchedulerSettings(max_num_batched_tokens=BUDGET), torch_threads=1,
    ))  # fmt: skip


def live_colocated(rds: redis.Redis, keys: Keys) -> list[WorkerStatus]:
    return live_workers(rds, keys, "colocated")


def assert_clean(rds: redis.Redis, keys: Keys) -> None:
    """Every live worker's pool empty, and every request's stream entry acknowledged."""
    until(lambda: all(s.free_blocks == s.total_blocks and s.num_running == 0 for s in live_colocated(rds, keys)),
          "every colocated worker to free its blocks")
    assert rds.xpending(keys.requests, PREFILL_GROUP)["pending"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completion_prefilled_in_chunks_equals_the_offline_engine(
    client: OpenAI, model: str, llm: LLM, stream: bool
) -> None:
    prompt = PROMPTS[stream]
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, logprobs=0))[0]
    assert len(expected.prompt_token_ids) > BUDGET
    if stream:
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == expected.text
        assert chunks[-1].choices[0].finish_reason == expected.finish_reason
        return
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens == token_texts(llm, expected.token_ids)
    assert (choice.text, choice.finish_reason) == (expected.text, expected.finish_reason)
    assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)


@pytest.mark.slow
def test_a_client_that_leaves_frees_the_blocks_of_its_request(
    client: OpenAI, model: str, stack: Stack, rds: redis.Redis
) -> None:
    stream = client.completions.create(
        model=model, prompt="Tell me a long story.", max_tokens=1200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    until(lambda: sum(s.num_running for s in live_colocated(rds, stack.keys)) == 1, "the request to run")
    stream.close()
    assert_clean(rds, stack.keys)


def seeded(client: OpenAI, model: str, on_token: Callable[[int], None] = lambda n: None) -> str:
    return streamed_text(client, model, SEEDED_PROMPT, NUM_SEEDED_TOKENS, on_token, temperature=1.0, seed=11)


@pytest.mark.slow
def test_a_colocated_worker_killed_mid_generation_has_its_request_rerun_by_the_other(
    client: OpenAI, model: str, stack: Stack, rds: redis.Redis
) -> None:
    expected = seeded(client, model)
    assert_clean(rds, stack.keys)  # heartbeats lag up to an interval: the first run's holder must read idle first
    kill_holder = HolderKiller(stack, rds, "colocated")

    text = seeded(client, model, kill_holder)

    assert len(kill_holder.victims) == 1
    assert text == expected  # no token lost, none doubled, and the seed holds across the re-run
    assert [s.worker_id for s in live_colocated(rds, stack.keys)] != kill_holder.victims
    assert_clean(rds, stack.keys)
