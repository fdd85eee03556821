"""The greedy head (shared/model/greedy_head.py) gives the reference's tokens, the argmax of the
whole logits, and torch's answer for a row that has none."""

from __future__ import annotations

import pytest
import torch

from kernels import greedy_head
from shared.model.greedy_head import GreedyHead
from tests.kernels.c_kernels import require_built


@pytest.fixture(autouse=True)
def built() -> None:
    require_built(greedy_head.load, "the greedy head kernel")


def reference(hidden: torch.Tensor, weight: torch.Tensor) -> list[int]:
    return (hidden @ weight.t()).max(dim=-1).indices.tolist()


def test_tokens_are_the_whole_logits_argmax() -> None:
    generator = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(3000, 64, generator=generator), torch.randn(70, 64, generator=generator)
    weight[2999] = 4 * weight[2999]  # some rows' best token in the last, partial panel
    assert GreedyHead(weight).greedy(hidden) == reference(hidden, weight)


def test_a_row_without_a_finite_logit_gets_torchs_answer() -> None:
    weight, hidden = torch.randn(3000, 8), torch.randn(4, 8)
    hidden[2] = torch.nan
    assert GreedyHead(weight).greedy(hidden) == reference(hidden, weight)
