"""The compiled Triton kernels on a real GPU against the PyTorch references, at model sizes."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref
from kernels.paged_attention import paged_attention, paged_attention_ref, paged_attention_triton
from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary, apply_rotary_ref
from tests.kernels.paged_batch import dense_causal_attention, make_paged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DTYPES = [torch.float32, torch.bfloat16]
ATTENTION_TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}
ONE_ULP = {torch.float32: {"atol": 1e-6, "rtol": 1e-6}, torch.bfloat16: {"atol": 1e-6, "rtol": 2**-7}}
# (num_heads, num_kv_heads, head_dim, block_size)
SHAPES = [(32, 8, 128, 16), (9, 3, 64, 32), (16, 16, 128, 16)]


def _seq_lens(num_reqs: int, longest: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, longest + 1, (num_reqs,), generator=gen).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("partition_size", [64, 512])
def test_decode_matches_ref(shape: tuple[int, int, int, int], partition_size: int, dtype: torch.dtype) -> None:
    seq_lens = [*_seq_lens(30, 3000, seed=1), 1, 4096]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), *shape, dtype=dtype, device="cuda")
    out = paged_attention_triton(*batch.args, partition_size=partition_size)
    torch.testing.assert_close(out, paged_attention_ref(*batch.args), **ATTENTION_TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_masks_each_request_to_its_length(dtype: torch.dtype) -> None:
    # cuDNN's attention, were the reference to use it, lets a few rows read the poisoned slots here
    seq_lens = [*_seq_lens(30, 3000, seed=1), 1, 4096]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), *SHAPES[0], dtype=dtype, device="cuda")
    exact = dense_causal_attention(batch)
    torch.testing.assert_close(paged_attention_ref(*batch.args).double(), exact, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_extend_matches_ref(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    # a decode, two fresh prompts and two prefills on cached prefixes
    seq_lens, query_lens = [700, 1, 300, 1500, 129], [1, 1, 300, 700, 128]
    batch = make_paged_batch(seq_lens, query_lens, *shape, dtype=dtype, device="cuda")
    out = paged_attention(*batch.args)
    torch.testing.assert_close(out, paged_attention_ref(*batch.args), **ATTENTION_TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_ref(with_residual: bool, dtype: torch.dtype) -> None:
    x = torch.randn(300, 4096, device="cuda").to(dtype)
    residual = torch.randn_like(x) if with_residual else None
    weight = (1 + 0.1 * torch.randn(4096, device="cuda")).to(dtype)
    out, residual_out = rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_residual_out = rms_norm_ref(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, ref_out, **ONE_ULP[dtype])
    assert torch.equal(residual_out, ref_residual_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_ref(dtype: torch.dtype) -> None:
    qkv = torch.randn(300, 48, 128, device="cuda").to(dtype)
    q, k = qkv[:, :32], qkv[:, 32:40]
    positions = torch.randint(0, 8192, (300,), device="cuda")
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    freqs = torch.arange(8192, device="cuda").float()[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    q_out, k_out = apply_rotary(q, k, positions, cache)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cache)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_ref(dtype: torch.dtype) -> None:
    x = (4 * torch.randn(300, 2 * 14336, device="cuda")).to(dtype)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **ONE_ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_matches_ref(dtype: torch.dtype) -> None:
    qkv = torch.randn(300, 48, 128, device="cuda").to(dtype)
    key, value = qkv[:, 32:40], qkv[:, 40:]
    slot_mapping = torch.randperm(100 * 16, device="cuda")[:300]
    caches = [torch.zeros(100, 16, 8, 128, dtype=dtype, device="cuda") for _ in range(4)]
    write_kv_cache(key, value, caches[0], caches[1], slot_mapping)
    write_kv_cache_ref(key, value, caches[2], caches[3], slot_mapping)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
