from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import rms_norm, rms_norm_ref, rms_norm_triton

EPS = 1e-6
# The variance is summed in a different order, so fp32 may differ in the last bits and a
# bf16 result may round the other way: one bf16 ulp.
TOLERANCES = {torch.float32: {"atol": 1e-6, "rtol": 1e-6}, torch.bfloat16: {"atol": 1e-6, "rtol": 2**-7}}


def _inputs(num_rows: int, hidden: int, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(hidden * 31 + num_rows)
    x, residual = (torch.randn(2, num_rows, hidden, generator=gen) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    return x.to(device), residual.to(device), weight.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(("num_rows", "hidden"), [(1, 64), (5, 96), (3, 576)])
def test_triton_matches_ref(
    num_rows: int, hidden: int, with_residual: bool, dtype: torch.dtype, triton_device: str
) -> None:
    x, residual, weight = _inputs(num_rows, hidden, dtype, triton_device)
    residual_in = residual if with_residual else None
    out, residual_out = rms_norm_triton(x, weight, EPS, residual_in)
    ref_out, ref_residual_out = rms_norm_ref(x, weight, EPS, residual_in)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, ref_out, **TOLERANCES[dtype])
    assert torch.equal(residual_out, ref_residual_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_is_bitwise_hf_llama_rms_norm_after_residual_add(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, residual, weight = _inputs(7, 576, dtype)
    hf_norm = LlamaRMSNorm(576, eps=EPS).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(weight)
        hf_residual = residual + x
        hf_out = hf_norm(hf_residual)
    out, residual_out = rms_norm_ref(x, weight, EPS, residual)
    assert torch.equal(out, hf_out)
    assert torch.equal(residual_out, hf_residual)
    assert torch.equal(rms_norm_ref(x, weight, EPS)[0], hf_norm(x).detach())


def test_without_residual_returns_input_as_residual() -> None:
    x, _, weight = _inputs(2, 64, torch.float32)
    _, residual_out = rms_norm(x, weight, EPS)
    assert residual_out is x


@pytest.mark.parametrize(
    ("weight", "residual", "message"),
    [
        (torch.ones(32), None, "weight shape \\(32,\\) must be \\(64,\\)"),
        (torch.ones(64, dtype=torch.bfloat16), None, "weight dtype torch.bfloat16 must equal x dtype"),
        (torch.ones(64), torch.zeros(3, 64), "residual \\(3, 64\\)"),
    ],
)
def test_bad_arguments_raise_value_error(weight: torch.Tensor, residual: torch.Tensor | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rms_norm(torch.zeros(2, 64), weight, EPS, residual)
