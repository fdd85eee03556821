from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton


def _gate_up(num_tokens: int, intermediate: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_tokens * 13 + intermediate)
    return (torch.randn(num_tokens, 2 * intermediate, generator=gen) * 4).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "intermediate"), [(1, 64), (4, 100), (3, 1536)])
def test_triton_matches_ref(num_tokens: int, intermediate: int, dtype: torch.dtype, triton_device: str) -> None:
    x = _gate_up(num_tokens, intermediate, dtype, triton_device)
    out = silu_and_mul_triton(x)
    assert out.shape == (num_tokens, intermediate) and out.dtype == dtype
    # exp differs in the last bits between numpy / CUDA and ATen's vectorised exp, so fp32
    # may differ in the last bits and a bf16 result may round the other way: one bf16 ulp
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-6, "rtol": 2**-7}
    torch.testing.assert_close(out, silu_and_mul_ref(x), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_ref_is_bitwise_hf_llama_mlp_activation(num_tokens: int, dtype: torch.dtype) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = LlamaConfig(hidden_size=64, intermediate_size=1537, hidden_act="silu")
    mlp = LlamaMLP(config).to(dtype)
    hidden = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
    with torch.no_grad():
        gate, up = mlp.gate_proj(hidden), mlp.up_proj(hidden)
        hf = mlp.act_fn(gate) * up
    assert torch.equal(silu_and_mul_ref(torch.cat((gate, up), dim=-1)), hf)


def test_odd_width_raises_value_error() -> None:
    with pytest.raises(ValueError, match="2 \\* intermediate_size\\], got \\(2, 7\\)"):
        silu_and_mul(torch.zeros(2, 7))
