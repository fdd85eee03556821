"""The greedy head by slices of the vocabulary (shared/model/greedy_head.py) gives the reference's
tokens: the argmax of the whole logits."""

from __future__ import annotations

import pytest
import torch

from kernels import gumbel_argmax
from shared.model.greedy_head import VOCAB_SLICE, SlicedGreedyHead
from tests.kernels.c_kernels import require_built


@pytest.fixture(autouse=True)
def built() -> None:
    require_built(gumbel_argmax.load, "the argmax kernel")


def reference(hidden: torch.Tensor, weight: torch.Tensor) -> list[int]:
    return (hidden @ weight.t()).max(dim=-1).indices.tolist()


@pytest.mark.parametrize(("rows", "vocab"), [(1, VOCAB_SLICE), (70, 3 * VOCAB_SLICE + 17), (5, 100)])
def test_tokens_are_the_whole_logits_argmax(rows: int, vocab: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight, hidden = torch.randn(vocab, 64, generator=generator), torch.randn(rows, 64, generator=generator)
    weight[vocab - 1] = 4 * weight[vocab - 1]  # some rows' best token in the last, partial slice
    assert SlicedGreedyHead(weight).greedy(hidden) == reference(hidden, weight)


def test_a_tie_across_slices_goes_to_the_first_token() -> None:
    weight = torch.zeros(2 * VOCAB_SLICE + 3, 4)
    weight[[7, VOCAB_SLICE + 7, 2 * VOCAB_SLICE + 1]] = 1.0
    assert SlicedGreedyHead(weight).greedy(torch.ones(3, 4)) == [7, 7, 7]


def test_a_row_without_a_finite_logit_gets_torchs_answer() -> None:
    weight, hidden = torch.randn(3000, 8), torch.randn(4, 8)
    hidden[2] = torch.nan
    assert SlicedGreedyHead(weight).greedy(hidden) == reference(hidden, weight)


def test_refuses_a_weight_it_cannot_slice() -> None:
    with pytest.raises(ValueError, match="float32"):
        SlicedGreedyHead(torch.zeros(10, 4, dtype=torch.bfloat16))
