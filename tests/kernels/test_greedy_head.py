"""The greedy head kernel (kernels/greedy_head.py) against its reference, the argmax of the whole
logits. Small integers for the weights and hidden states make every logit exact in float32 whatever
the order of its sum, so the tokens must match to the index, and ties are common."""

from __future__ import annotations

import pytest
import torch

from kernels import greedy_head
from kernels.greedy_head import PackedHead, reference_argmax
from tests.kernels.c_kernels import require_built


@pytest.fixture(autouse=True)
def built() -> None:
    require_built(greedy_head.load, "the greedy head kernel")


def small_integers(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(seed)).float()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "vocab", "hidden"), [(1, 16, 8), (7, 1000, 64), (70, 5003, 64), (9, 301, 576)])
def test_tokens_are_the_whole_logits_first_argmax(rows: int, vocab: int, hidden: int, threads: int) -> None:
    weight, x = small_integers(vocab, hidden, seed=vocab), small_integers(rows, hidden, seed=rows)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # two threads split the vocabulary: ties across their halves too
    try:
        assert torch.equal(PackedHead(weight).argmax(x), reference_argmax(x, weight))
    finally:
        torch.set_num_threads(previous)


def test_a_tie_goes_to_the_first_token_across_panels_and_lanes() -> None:
    weight = torch.zeros(40_000, 4)
    weight[[17, 33, 20_000, 39_999]] = 1.0
    assert PackedHead(weight).argmax(torch.ones(3, 4)).tolist() == [17, 17, 17]
    weight[17] = 0.5  # the tie is now between lane 1 of panel 2 and a far later panel
    assert PackedHead(weight).argmax(torch.ones(1, 4)).tolist() == [33]


def test_a_row_without_a_logit_above_minus_infinity_gets_minus_one() -> None:
    weight, x = small_integers(100, 8, seed=0), small_integers(3, 8, seed=1)
    x[1] = torch.nan
    ids = PackedHead(weight).argmax(x)
    assert ids[1] == -1 and torch.equal(ids[[0, 2]], reference_argmax(x[[0, 2]], weight))


def test_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="float32"):
        PackedHead(torch.zeros(10, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"float32 \[rows, 4\]"):
        PackedHead(torch.zeros(10, 4)).argmax(torch.zeros(2, 5))
