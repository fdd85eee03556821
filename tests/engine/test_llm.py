"""The offline API on the real model: text in and out, stop strings, seeds, logprobs, bf16."""

from __future__ import annotations

import math

import pytest

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings


@pytest.fixture(scope="module")
def llm(model_path: str) -> LLM:
    return LLM(settings=EngineSettings(
        model=ModelSettings(path=model_path, dtype="float32", device="cpu"),
        kv_cache=KVCacheSettings(memory_bytes=256 * 2**20),
    ))


def test_greedy_text_completion(llm: LLM) -> None:
    [out] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_stop_string_ends_text_before_it(llm: LLM) -> None:
    [full] = llm.generate(["Count: one, two, three,"], SamplingParams(max_tokens=12, temperature=0.0))
    stop = full.text.strip()[:3]
    [cut] = llm.generate(["Count: one, two, three,"], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    assert full.text.startswith(cut.text)


def test_seeded_request_ignores_its_batch_neighbours(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    [alone] = llm.generate(["Once upon a time"], seeded)
    crowd = llm.generate(
        ["Hello there", "Once upon a time", "List three colours:"],
        [SamplingParams(max_tokens=9, temperature=0.8), seeded, SamplingParams(max_tokens=5, temperature=0.0)],
    )
    assert crowd[1].token_ids == alone.token_ids
    [other_seed] = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, temperature=1.0, seed=99))
    assert other_seed.token_ids != alone.token_ids


def test_logprobs_are_sorted_and_include_the_chosen_token(llm: LLM) -> None:
    [out] = llm.generate(["The sky is"], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))
    assert len(out.logprobs) == len(out.token_ids) == len(out.top_logprobs) == 4
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert [t for t, _ in top][0] == token  # greedy: the chosen token is the most likely
        assert math.isclose(top[0][1], logprob, abs_tol=1e-5)
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    [natural] = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0))
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in llm.tokenizer.eos_token_ids
    [forced] = llm.generate([prompt], SamplingParams(max_tokens=len(natural.token_ids) + 3, temperature=0.0,
                                                      ignore_eos=True))
    assert forced.finish_reason == "length" and forced.token_ids[: len(natural.token_ids)] == natural.token_ids


def test_min_tokens_holds_off_eos(llm: LLM) -> None:
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    [natural] = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0))
    n = len(natural.token_ids)
    [longer] = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0, min_tokens=n + 2))
    assert len(longer.token_ids) >= n + 3
    assert all(t not in llm.tokenizer.eos_token_ids for t in longer.token_ids[: n + 2])


def test_bfloat16_engine_answers_like_float32(model_path: str) -> None:
    llm16 = LLM(settings=EngineSettings(model=ModelSettings(path=model_path, dtype="bfloat16", device="cpu"),
                                        kv_cache=KVCacheSettings(memory_bytes=64 * 2**20)))
    [out] = llm16.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0.0))
    assert "Paris" in out.text


def test_the_layer_hooks_run_twice_within_and_once_after_every_decoder_layer_of_every_step(llm: LLM) -> None:
    model = llm.engine.runner.model
    calls: list[tuple[int, str]] = []
    model.between_layers = lambda: calls.append((llm.engine.num_steps, "between"))
    model.within_layer = lambda: calls.append((llm.engine.num_steps, "within"))
    try:
        steps_before = llm.engine.num_steps
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finally:
        model.between_layers = model.within_layer = None
    num_layers = model.config.num_layers
    one_layer = ["within", "within", "between"]
    assert calls == [(step, hook) for step in range(steps_before, steps_before + 3)
                     for _ in range(num_layers) for hook in one_layer]
