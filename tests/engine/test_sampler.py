from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.sampler import (
    Sampler,
    SamplingBatch,
    SamplingInput,
    build_sampling_batch,
    filter_logits,
    gumbel_noise,
    process_logits,
    row_keys,
)
from shared.engine.sampling_params import SamplingParams

EOS = 0
INF = math.inf


def make_row(
    params: SamplingParams, seed: int = 0, prompt: Sequence[int] = (), output: Sequence[int] = ()
) -> SamplingInput:
    return SamplingInput(params=params, seed=seed, prompt_token_ids=prompt, output_token_ids=output)


def batch_of(rows: Sequence[SamplingInput], vocab_size: int) -> SamplingBatch:
    return build_sampling_batch(rows, [EOS], vocab_size, "cpu")


def sample(rows: Sequence[SamplingInput], logits: torch.Tensor) -> list[int]:
    return Sampler()(logits, batch_of(rows, logits.shape[1])).token_ids


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def seeded_rows(params: SamplingParams, num_rows: int) -> list[SamplingInput]:
    return [make_row(params, seed=seed) for seed in range(num_rows)]


# --- greedy ---------------------------------------------------------------------------------


def test_plain_greedy_batch_is_argmax_with_first_index_on_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]])
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(2)]
    batch = batch_of(rows, 4)

    output = Sampler()(logits, batch)

    assert batch.is_plain_greedy
    assert output.token_ids == [1, 0]
    assert output.logprobs is None and output.top_logprobs is None


def test_greedy_matches_torch_argmax_on_a_batch_full_of_ties() -> None:
    logits = torch.randint(0, 3, (16, 1000), generator=torch.Generator().manual_seed(0)).float()
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(16)]
    mixed = [*rows[:8], make_row(SamplingParams(temperature=1.0)), *rows[8:]]
    mixed_logits = torch.cat([logits[:8], logits[:1], logits[8:]])

    tokens = sample(mixed, mixed_logits)

    assert sample(rows, logits) == logits.argmax(dim=-1).tolist()
    assert tokens[:8] + tokens[9:] == logits.argmax(dim=-1).tolist()


def test_greedy_ignores_top_k_top_p_min_p_and_seed() -> None:
    logits = torch.tensor([[0.0, 1.0, 4.0, 2.0]])
    params = SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9, seed=3)

    assert sample([make_row(params, seed=3)], logits) == [2]


def test_greedy_with_penalties_takes_argmax_of_processed_logits() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0]])
    row = make_row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[1])
    batch = batch_of([row], 4)

    assert process_logits(logits, batch).tolist() == [[1.0, 2.0, 2.5, 0.0]]
    assert Sampler()(logits, batch).token_ids == [2]


# --- penalties and min_tokens ---------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    row = make_row(SamplingParams(repetition_penalty=2.0), prompt=[0, 0], output=[1])

    processed = process_logits(logits, batch_of([row], 5))

    assert processed.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, -1.0, 0.5]]  # the caller's tensor is untouched


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    row = make_row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[0, 2], output=[1, 3, 1])

    processed = process_logits(logits, batch_of([row], 5))

    # token 1: -2 - (0.5 + 2 * 0.25); token 3: -1 - (0.5 + 0.25)
    assert processed.tolist() == [[2.0, -3.0, 1.0, -1.75, 0.5]]


def test_negative_presence_penalty_raises_seen_logits() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0]])
    row = make_row(SamplingParams(presence_penalty=-1.0), output=[2, 2])

    assert process_logits(logits, batch_of([row], 3)).tolist() == [[0.0, 0.0, 1.0]]


def test_repetition_applies_before_presence_and_frequency() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    row = make_row(
        SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5), prompt=[0], output=[1]
    )

    assert process_logits(logits, batch_of([row], 3)).tolist() == [[1.0, -5.5, 1.0]]


def test_penalties_touch_only_the_rows_that_ask_for_them() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0], [2.0, -2.0, 1.0]])
    rows = [make_row(SamplingParams(), prompt=[0], output=[1]),
            make_row(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), prompt=[0], output=[1])]

    assert process_logits(logits, batch_of(rows, 3)).tolist() == [[2.0, -2.0, 1.0], [1.0, -5.0, 1.0]]


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.tensor([[9.0, 1.0, 2.0, 8.0, 3.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    early = batch_of([make_row(params, output=[4])], 5)
    reached = batch_of([make_row(params, output=[4, 4])], 5)

    assert process_logits(logits, early).tolist() == [[-INF, 1.0, 2.0, -INF, 3.0]]
    assert Sampler()(logits, early).token_ids == [4]
    assert process_logits(logits, reached) is logits
    assert Sampler()(logits, reached).token_ids == [0]


def test_min_tokens_keeps_sampled_rows_off_eos() -> None:
    logits = torch.tensor([[3.0, 3.0, 0.0, 3.0]])
    params = SamplingParams(temperature=1.5, min_tokens=1, stop_token_ids=[3])

    tokens = sample(seeded_rows(params, 300), logits.expand(300, 4))

    assert set(tokens) == {1, 2}


# --- filters --------------------------------------------------------------------------------


def test_temperature_divides_the_logits_of_sampled_rows() -> None:
    logits = torch.tensor([[1.0, -2.0, 3.0], [1.0, 1.0, 1.0]])
    rows = [make_row(SamplingParams(temperature=0.5)), make_row(SamplingParams(temperature=0.0))]

    assert filter_logits(logits, batch_of(rows, 3)).tolist() == [[2.0, -4.0, 6.0]]


def test_top_k_keeps_the_k_largest_and_their_ties() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 0.0, 2.0], [1.0, 2.0, 2.0, 0.0, 2.0]])
    rows = [make_row(SamplingParams(top_k=2)), make_row(SamplingParams(top_k=1))]

    filtered = filter_logits(logits, batch_of(rows, 5))

    assert filtered.tolist() == [[-INF, 4.0, 3.0, -INF, -INF], [-INF, 2.0, 2.0, -INF, 2.0]]


def test_top_k_never_samples_outside_the_top_k() -> None:
    logits = torch.tensor([2.0, 0.5, 1.9, 1.8, 1.7, 1.6])

    tokens = sample(seeded_rows(SamplingParams(top_k=2), 500), logits.expand(500, 6))

    assert set(tokens) == {0, 2}


def test_top_p_keeps_tokens_while_the_mass_ranked_above_is_below_p() -> None:
    logits = log_probs(0.15, 0.5, 0.05, 0.3)
    rows = [make_row(SamplingParams(top_p=p)) for p in (0.75, 0.85, 0.4)]

    filtered = filter_logits(logits.expand(3, 4), batch_of(rows, 4))

    assert torch.isfinite(filtered).tolist() == [
        [False, True, False, True], [True, True, False, True], [False, True, False, False]
    ]
    assert filtered[0, 1] == logits[1] and filtered[0, 3] == logits[3]


def test_top_p_never_samples_outside_the_nucleus() -> None:
    logits = log_probs(0.15, 0.5, 0.05, 0.3)

    tokens = sample(seeded_rows(SamplingParams(top_p=0.75), 500), logits.expand(500, 4))

    assert set(tokens) == {1, 3}


def test_top_p_renormalises_after_top_k() -> None:
    # After top-k the kept pair is (4/7, 3/7); 4/7 >= 0.5 so top-p drops token 1 although 0.4 < 0.5.
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    row = make_row(SamplingParams(top_k=2, top_p=0.5))

    kept = torch.isfinite(filter_logits(logits.unsqueeze(0), batch_of([row], 4)))

    assert kept.tolist() == [[True, False, False, False]]


def test_top_p_matches_a_full_sort_when_the_nucleus_exceeds_the_candidate_window() -> None:
    vocab_size = 4000
    logits = torch.randn(2, vocab_size, generator=torch.Generator().manual_seed(0)) * 0.3
    rows = [make_row(SamplingParams(top_p=0.6)), make_row(SamplingParams(top_p=0.9))]

    kept = torch.isfinite(filter_logits(logits, batch_of(rows, vocab_size)))

    probs = logits.double().softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    expected = torch.zeros_like(kept).scatter_(1, order, mass_above < torch.tensor([[0.6], [0.9]], dtype=torch.float64))
    assert kept.sum(dim=-1).min() > 1024
    assert torch.equal(kept, expected)


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability_after_temperature() -> None:
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    rows = [make_row(SamplingParams(min_p=0.2)), make_row(SamplingParams(min_p=0.2, temperature=2.0))]

    kept = torch.isfinite(filter_logits(logits.expand(2, 4), batch_of(rows, 4)))

    # At temperature 2 the ratios are square-rooted: sqrt(0.05 / 0.5) = 0.32 >= 0.2.
    assert kept.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_min_p_never_samples_below_its_threshold() -> None:
    logits = log_probs(0.5, 0.05, 0.3, 0.15)

    tokens = sample(seeded_rows(SamplingParams(min_p=0.25), 500), logits.expand(500, 4))

    assert set(tokens) == {0, 2, 3}


# --- seeded randomness ----------------------------------------------------------------------


def generate(params: SamplingParams, seed: int, step_logits: torch.Tensor, output: Sequence[int] = ()) -> list[int]:
    """Samples one token per remaining step, as a decode loop with a fixed 'model' would."""
    output = list(output)
    for position in range(len(output), step_logits.shape[0]):
        output += sample([make_row(params, seed=seed, output=output)], step_logits[position].unsqueeze(0))
    return output


STEP_LOGITS = torch.randn(24, 50, generator=torch.Generator().manual_seed(1))


def test_same_seed_gives_the_same_tokens() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95)

    assert generate(params, 7, STEP_LOGITS) == generate(params, 7, STEP_LOGITS)


def test_different_seeds_give_different_tokens() -> None:
    params = SamplingParams(temperature=1.0)
    sequences = {tuple(generate(params, seed, STEP_LOGITS)) for seed in range(5)}

    assert len(sequences) == 5


def test_seeds_that_differ_only_above_32_bits_differ() -> None:
    seed_lo = torch.tensor([5, 5, 5])
    keys = row_keys(seed_lo, torch.tensor([0, 1, 2**32 - 1]), torch.tensor([0, 0, 0]))

    assert len(set(keys.tolist())) == 3


def test_a_resumed_request_continues_with_the_same_tokens() -> None:
    params = SamplingParams(temperature=0.8, top_k=20)
    full = generate(params, 11, STEP_LOGITS)

    assert generate(params, 11, STEP_LOGITS, output=full[:10]) == full


def test_a_seeded_row_samples_the_same_token_in_any_batch() -> None:
    target = make_row(SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01), seed=42, output=[3, 4])
    others = [
        make_row(SamplingParams(temperature=0.0)),
        make_row(SamplingParams(temperature=1.3, top_k=3, repetition_penalty=1.3), seed=1, prompt=[1], output=[2]),
        make_row(SamplingParams(temperature=0.7, min_tokens=5, frequency_penalty=1.0), seed=2, output=[1]),
    ]
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    alone = sample([target], logits[:1])

    for position in range(4):
        rows = others[:position] + [target] + others[position:]
        batch_logits = torch.cat([logits[1 : position + 1], logits[:1], logits[position + 1 :]])
        assert sample(rows, batch_logits)[position] == alone[0]


def test_gumbel_noise_is_a_function_of_key_and_vocab_id() -> None:
    keys = row_keys(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([7, 7]))
    vocab_ids = torch.arange(100_000)

    noise = gumbel_noise(keys, vocab_ids)

    assert torch.equal(noise[1], gumbel_noise(keys[1:], vocab_ids)[0])
    picked_ids = torch.tensor([[5, 99_999], [0, 17]])
    assert torch.equal(gumbel_noise(keys, picked_ids), noise.gather(1, picked_ids))
    assert abs(noise.mean().item() - 0.5772) < 0.02  # Euler-Mascheroni, the Gumbel mean
    assert abs(noise.var().item() - math.pi**2 / 6) < 0.05


def test_noise_drawn_only_for_filtered_candidates_samples_as_dense_noise() -> None:
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3))
    filtered = seeded_rows(SamplingParams(top_k=3, temperature=2.0), 200)
    unfiltered = make_row(SamplingParams(temperature=1.0))

    sparse = sample(filtered, logits.expand(200, 64))
    dense = sample([*filtered, unfiltered], logits.expand(201, 64))[:200]

    assert sparse == dense
    assert len(set(sparse)) == 3


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_frequencies_follow_the_tempered_distribution(temperature: float) -> None:
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    num_positions = 6000
    rows = [make_row(SamplingParams(temperature=temperature), seed=9, output=range(i)) for i in range(num_positions)]

    tokens = sample(rows, probs.log().float().expand(num_positions, 3))

    expected = (probs ** (1 / temperature)) / (probs ** (1 / temperature)).sum()
    counts = Counter(tokens)
    for token_id, p in enumerate(expected.tolist()):
        bound = 5 * math.sqrt(p * (1 - p) / num_positions)
        assert abs(counts[token_id] / num_positions - p) < bound
    # Neighbouring positions are independent: a repeat is as likely as two independent draws.
    repeat_rate = sum(a == b for a, b in zip(tokens, tokens[1:])) / (num_positions - 1)
    p_repeat = (expected**2).sum().item()
    assert abs(repeat_rate - p_repeat) < 5 * math.sqrt(p_repeat * (1 - p_repeat) / num_positions)


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_of_the_chosen_and_top_tokens() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    rows = [
        make_row(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=2.0), prompt=[1]),
        make_row(SamplingParams(temperature=1.0, logprobs=0), seed=3),
        make_row(SamplingParams(temperature=0.0)),
    ]

    output = Sampler()(logits, batch_of(rows, 4))

    raw = logits.log_softmax(dim=-1)
    assert output.token_ids[0] == 2  # penalised to 1.5, but logprobs stay raw
    assert output.logprobs == [raw[row, token].item() for row, token in enumerate(output.token_ids)]
    assert output.top_logprobs == [[(1, raw[0, 1].item()), (2, raw[0, 2].item())], [], []]


# --- batch-composition independence (property) ----------------------------------------------

VOCAB = 32

params_strategy = st.builds(
    SamplingParams,
    max_tokens=st.just(64),
    min_tokens=st.integers(0, 3),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.none() | st.integers(1, VOCAB + 5),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    repetition_penalty=st.sampled_from([1.0, 1.2, 0.8]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3]),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2),
    logprobs=st.none() | st.integers(0, 4),
)
row_strategy = st.builds(
    make_row,
    params_strategy,
    seed=st.integers(0, 2**64 - 1),
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=6),
    output=st.lists(st.integers(0, VOCAB - 1), max_size=6),
)


@settings(max_examples=60, deadline=None)
@given(
    target=row_strategy,
    others=st.lists(row_strategy, max_size=5),
    position=st.integers(0, 5),
    logits_seed=st.integers(0, 2**31),
)
def test_a_row_samples_independently_of_the_rest_of_its_batch(
    target: SamplingInput, others: list[SamplingInput], position: int, logits_seed: int
) -> None:
    position = min(position, len(others))
    logits = torch.randn(len(others) + 1, VOCAB, generator=torch.Generator().manual_seed(logits_seed)) * 3
    alone = Sampler()(logits[:1], batch_of([target], VOCAB))

    rows = others[:position] + [target] + others[position:]
    batch_logits = torch.cat([logits[1 : position + 1], logits[:1], logits[position + 1 :]])
    together = Sampler()(batch_logits, batch_of(rows, VOCAB))

    assert together.token_ids[position] == alone.token_ids[0]
    if target.params.logprobs is not None:
        assert together.logprobs is not None and alone.logprobs is not None
        assert together.logprobs[position] == alone.logprobs[0]
        assert together.top_logprobs is not None and alone.top_logprobs is not None
        assert together.top_logprobs[position] == alone.top_logprobs[0]
