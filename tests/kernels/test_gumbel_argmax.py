"""Gumbel-max sampling on the CPU (kernels/csrc/gumbel_argmax.c) against the sampler's PyTorch
reference (`gumbel_noise`, then an argmax), and the sampler's use of it."""

from __future__ import annotations

import pytest
import torch

from kernels import gumbel_argmax as kernel
from shared.engine import sampler
from shared.engine.sampler import _VOCAB_SALT, gumbel_noise
from tests.kernels.c_kernels import require_built

VOCAB = 49152  # the default model's


@pytest.fixture(autouse=True)
def built() -> None:
    require_built(kernel.load, "the Gumbel-max kernel")


def reference(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return (scores + gumbel_noise(keys, torch.arange(scores.shape[1]))).max(dim=-1).indices


def random_keys(rows: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2**32, (rows,), dtype=torch.int64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_samples_the_references_tokens(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    scores = torch.randn(rows, VOCAB, generator=gen) * 4
    scores[:, 5::7] = -torch.inf  # filtered out, as top-k and top-p leave them
    keys = random_keys(rows, rows)
    assert torch.equal(kernel.gumbel_argmax(scores, keys, _VOCAB_SALT), reference(scores, keys))


def test_the_noise_alone_picks_the_references_token() -> None:
    """Equal scores: the token is the noise's argmax, so this compares the noise itself, row by row."""
    scores = torch.zeros(512, 1000)
    keys = random_keys(512, 7)
    assert torch.equal(kernel.gumbel_argmax(scores, keys, _VOCAB_SALT), reference(scores, keys))


def test_reads_rows_by_their_stride() -> None:
    wide = torch.randn(4, 2 * VOCAB)
    scores = wide[:, :VOCAB]
    keys = random_keys(4, 1)
    assert torch.equal(kernel.gumbel_argmax(scores, keys, _VOCAB_SALT), reference(scores.contiguous(), keys))


def test_the_sampler_draws_the_same_tokens_with_and_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    scores = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    keys = random_keys(16, 3)
    with_kernel = sampler._gumbel_argmax(scores.clone(), keys)
    monkeypatch.setattr(kernel, "load", lambda: None)
    assert torch.equal(sampler._gumbel_argmax(scores.clone(), keys), with_kernel)


def test_bad_arguments_are_named() -> None:
    keys = random_keys(2, 0)
    with pytest.raises(ValueError, match="float32"):
        kernel.gumbel_argmax(torch.zeros(2, 8, dtype=torch.bfloat16), keys, _VOCAB_SALT)
    with pytest.raises(ValueError, match="keys"):
        kernel.gumbel_argmax(torch.zeros(3, 8), keys, _VOCAB_SALT)
    with pytest.raises(ValueError, match="no finite"):
        kernel.gumbel_argmax(torch.full((2, 8), -torch.inf), keys, _VOCAB_SALT)


@pytest.mark.parametrize(("rows", "vocab"), [(1, VOCAB), (5, 511), (7, 1031), (64, VOCAB), (3, 17)])
def test_argmax_is_torchs_indexed_max(rows: int, vocab: int) -> None:
    scores = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
    scores[0, vocab // 3] = -torch.inf
    assert torch.equal(kernel.argmax(scores), scores.max(dim=-1).indices)


def test_argmax_takes_the_first_of_tied_maxima_across_blocks() -> None:
    scores = torch.zeros(4, VOCAB)
    for row, ids in enumerate([(0, 5), (700, 1400), (513, 40000), (VOCAB - 1,)]):
        scores[row, list(ids)] = 3.0
    assert kernel.argmax(scores).tolist() == [0, 700, 513, VOCAB - 1]
    assert torch.equal(kernel.argmax(scores), scores.max(dim=-1).indices)


def test_argmax_reads_rows_by_their_stride() -> None:
    wide = torch.randn(6, 3000, generator=torch.Generator().manual_seed(1))
    scores = wide[:, :2500]
    assert torch.equal(kernel.argmax(scores), scores.max(dim=-1).indices)


def test_argmax_refuses_a_row_without_a_maximum_and_the_sampler_falls_back_to_torch() -> None:
    scores = torch.randn(2, 64)
    scores[1] = -torch.inf
    with pytest.raises(ValueError, match="no value above -inf"):
        kernel.argmax(scores)
    assert torch.equal(sampler._argmax(scores), scores.max(dim=-1).indices)
    with pytest.raises(ValueError, match="float32"):
        kernel.argmax(torch.zeros(2, 8, dtype=torch.bfloat16))
