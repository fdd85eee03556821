from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from bench.serving.workload import (
    BenchRequest,
    WorkloadSpec,
    as_text,
    build_workload,
    vocab_from_size,
    vocab_from_tokenizer,
    warmup_requests,
)

VOCAB = vocab_from_size(1000)


def test_random_has_exact_lengths_without_range_ratio() -> None:
    requests = build_workload(WorkloadSpec("random", num_prompts=10, input_len=32, output_len=7), VOCAB, seed=0)
    assert len(requests) == 10
    assert {(len(r.prompt), r.num_prompt_tokens, r.max_tokens) for r in requests} == {(32, 32, 7)}
    assert all(isinstance(r.prompt, list) and min(r.prompt) >= 0 and max(r.prompt) < 1000 for r in requests)


def test_random_range_ratio_spreads_lengths_within_bounds() -> None:
    spec = WorkloadSpec("random", num_prompts=400, input_len=100, output_len=10, range_ratio=0.5)
    requests = build_workload(spec, VOCAB, seed=0)
    input_lens = {r.num_prompt_tokens for r in requests}
    output_lens = {r.max_tokens for r in requests}
    assert min(input_lens) == 50 and max(input_lens) == 150
    assert min(output_lens) == 5 and max(output_lens) == 15


@pytest.mark.parametrize("name", ["random", "shared-prefix", "chat-mix"])
def test_same_seed_gives_same_requests_and_other_seed_differs(name: str) -> None:
    spec = WorkloadSpec(name, num_prompts=16, input_len=20, output_len=5, prefix_len=8, suffix_len=4, num_groups=2)
    first = build_workload(spec, VOCAB, seed=3)
    assert build_workload(spec, VOCAB, seed=3) == first
    assert build_workload(spec, VOCAB, seed=4) != first


def test_shared_prefix_groups_share_prefix_and_keep_unique_suffixes() -> None:
    spec = WorkloadSpec("shared-prefix", num_prompts=12, output_len=9, num_groups=3, prefix_len=16, suffix_len=4)
    requests = build_workload(spec, VOCAB, seed=0)
    assert {(r.num_prompt_tokens, r.max_tokens) for r in requests} == {(20, 9)}
    prefixes = Counter(tuple(r.prompt[:16]) for r in requests)
    assert sorted(prefixes.values()) == [4, 4, 4]
    assert len({tuple(r.prompt[16:]) for r in requests}) == 12


def test_shared_prefix_order_is_shuffled() -> None:
    spec = WorkloadSpec("shared-prefix", num_prompts=40, num_groups=4, prefix_len=8, suffix_len=2)
    groups = [tuple(r.prompt[:8]) for r in build_workload(spec, VOCAB, seed=0)]
    round_robin = [groups[i % 4] for i in range(40)]
    assert groups != round_robin


def test_chat_mix_lengths_are_long_tailed_and_clipped() -> None:
    spec = WorkloadSpec("chat-mix", num_prompts=2000, input_len=100, output_len=50, length_sigma=1.0)
    requests = build_workload(spec, vocab_from_size(50), seed=0)
    input_lens = np.array([r.num_prompt_tokens for r in requests])
    output_lens = np.array([r.max_tokens for r in requests])
    assert input_lens.min() >= 1 and input_lens.max() == 400
    assert output_lens.min() >= 1 and output_lens.max() == 200
    assert 90 <= np.median(input_lens) <= 110
    assert 45 <= np.median(output_lens) <= 55
    assert input_lens.mean() > np.median(input_lens)


def test_chat_mix_requests_do_not_depend_on_how_many_are_drawn() -> None:
    def mix(num_prompts: int) -> list[BenchRequest]:
        return build_workload(WorkloadSpec("chat-mix", num_prompts, input_len=30, output_len=20), VOCAB, seed=5)

    assert mix(40)[:12] == mix(12)


def test_chat_mix_honours_explicit_clips() -> None:
    spec = WorkloadSpec("chat-mix", num_prompts=500, input_len=100, output_len=50, max_input_len=120, max_output_len=60)
    requests = build_workload(spec, vocab_from_size(50), seed=0)
    assert max(r.num_prompt_tokens for r in requests) == 120
    assert max(r.max_tokens for r in requests) == 60


def test_warmups_mirror_shapes_with_fresh_tokens() -> None:
    requests = build_workload(WorkloadSpec("random", num_prompts=5, input_len=12, output_len=3), VOCAB, seed=0)
    warmups = warmup_requests(requests, VOCAB, seed=0, num=2)
    assert [(w.num_prompt_tokens, w.max_tokens) for w in warmups] == [(12, 3), (12, 3)]
    assert all(w.prompt != r.prompt for w, r in zip(warmups, requests[:2], strict=True))
    assert warmup_requests(requests, VOCAB, seed=0, num=2) == warmups


def test_vocab_from_tokenizer_skips_special_ids() -> None:
    assert vocab_from_tokenizer(6, special_ids=[0, 2, 5]).tolist() == [1, 3, 4]


def test_as_text_decodes_prompt_and_keeps_counts() -> None:
    class Digits:
        def decode(self, token_ids: list[int]) -> str:
            return " ".join(str(i) for i in token_ids)

    assert as_text([BenchRequest([4, 5], 2, 7)], Digits()) == [BenchRequest("4 5", 2, 7)]


@pytest.mark.parametrize(
    "overrides",
    [{"name": "sharegpt"}, {"num_prompts": 0}, {"range_ratio": 1.0}, {"input_len": 0}, {"prefix_len": -1}],
)
def test_invalid_specs_are_rejected(overrides: dict[str, object]) -> None:
    fields: dict[str, object] = {"name": "random", "num_prompts": 1} | overrides
    with pytest.raises(ValueError):
        WorkloadSpec(**fields)  # type: ignore[arg-type]
