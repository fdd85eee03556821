"""The C kernels of kernels/csrc/layer_ops.c against their PyTorch references, and the dispatch to them."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_layer_ops
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.kv_cache_write import write_kv_cache_ref
from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary_ref, rotate_and_write_kv
from tests.kernels.c_kernels import require_built

DTYPES = [torch.float32, torch.bfloat16]
# float32: the variance and exp differ from ATen's in the last bits; bfloat16: one ulp
TOLERANCES = {torch.float32: {"atol": 1e-6, "rtol": 1e-6}, torch.bfloat16: {"atol": 1e-6, "rtol": 2**-7}}
EPS = 1e-5
MAX_POSITIONS = 2048
NUM_BLOCKS, BLOCK_SIZE = 8, 16


@pytest.fixture
def built() -> None:
    """For the tests that call the library (the fallback test runs without it)."""
    require_built(cpu_layer_ops.load, "the CPU layer kernels")


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# rows straddle the size at which the kernels go multi-threaded (64 x 576 does)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(("num_rows", "hidden"), [(1, 576), (7, 96), (64, 576)])
def test_rms_norm_matches_ref(num_rows: int, hidden: int, with_residual: bool, dtype: torch.dtype, built: None) -> None:
    x = _randn(num_rows, hidden, dtype=dtype, seed=num_rows)
    residual = _randn(num_rows, hidden, dtype=dtype, seed=num_rows + 1) if with_residual else None
    weight = (1 + 0.1 * _randn(hidden, dtype=torch.float32, seed=hidden, scale=1.0)).to(dtype)
    out, residual_out = cpu_layer_ops.rms_norm(x, weight, EPS, residual)
    ref_out, ref_residual_out = rms_norm_ref(x, weight, EPS, residual)
    torch.testing.assert_close(out, ref_out, **TOLERANCES[dtype])
    assert torch.equal(residual_out, ref_residual_out)  # one rounded add: exact
    assert (residual_out is x) == (residual is None)


def test_rms_norm_reads_rows_at_their_stride(built: None) -> None:
    wide = _randn(5, 200, dtype=torch.bfloat16, seed=3)
    x, residual = wide[:, :96], wide[:, 100:196]
    weight = torch.ones(96, dtype=torch.bfloat16)
    out, residual_out = rms_norm(x, weight, EPS, residual)
    ref_out, ref_residual_out = rms_norm_ref(x, weight, EPS, residual)
    torch.testing.assert_close(out, ref_out, **TOLERANCES[torch.bfloat16])
    assert torch.equal(residual_out, ref_residual_out)


def _cos_sin_cache(head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(MAX_POSITIONS, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _attention_inputs(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """q, k, v as views into one fused projection output, positions, and distinct slots."""
    qkv = _randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, seed=num_tokens * 7 + head_dim)
    gen = torch.Generator().manual_seed(num_tokens)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen)
    slot_mapping = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    return q, k, v, positions, slot_mapping


def _caches(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    return torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim"),
    # head_dim 40: 20 pairs, so the vector loop's 8 or 16 lanes leave a scalar tail
    [(1, 9, 3, 64), (5, 4, 4, 128), (100, 9, 3, 64), (7, 3, 1, 40)],
)
def test_rotary_and_cache_write_are_bitwise_the_references(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, built: None
) -> None:
    q, k, v, positions, slot_mapping = _attention_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    cos_sin = _cos_sin_cache(head_dim)
    ref_q, ref_k = apply_rotary_ref(q, k, positions, cos_sin)
    ref_k_cache, ref_v_cache = _caches(num_kv_heads, head_dim, dtype)
    write_kv_cache_ref(ref_k, v, ref_k_cache, ref_v_cache, slot_mapping)

    k_cache, v_cache = _caches(num_kv_heads, head_dim, dtype)
    q_out, k_out = rotate_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)

    assert q_out.data_ptr() == q.data_ptr()  # rotated in place
    assert torch.equal(q_out, ref_q) and torch.equal(k_out, ref_k)
    torch.testing.assert_close(k_cache, ref_k_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v_cache, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [("slot_mapping", NUM_BLOCKS * BLOCK_SIZE, r"slot_mapping values must lie in \[0, 128\), got min 0 max 128"),
     ("positions", -1, r"positions values must lie in \[0, 2048\), got min -1")],
)
def test_out_of_range_slots_or_positions_raise_before_anything_is_written(
    field: str, bad: int, message: str, built: None
) -> None:
    q, k, v, positions, slot_mapping = _attention_inputs(3, 4, 2, 64, torch.float32)
    slot_mapping[0] = 0
    {"slot_mapping": slot_mapping, "positions": positions}[field][-1] = bad
    q_before, k_cache, v_cache = q.clone(), *_caches(2, 64, torch.float32)
    with pytest.raises(ValueError, match=message):
        rotate_and_write_kv(q, k, v, positions, _cos_sin_cache(64), k_cache, v_cache, slot_mapping)
    assert torch.equal(q, q_before) and k_cache.isnan().all() and v_cache.isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "intermediate"), [(1, 1536), (3, 100), (64, 1536)])
def test_silu_and_mul_matches_ref(num_rows: int, intermediate: int, dtype: torch.dtype, built: None) -> None:
    x = _randn(num_rows, 2 * intermediate, dtype=dtype, seed=intermediate + num_rows)
    out = cpu_layer_ops.silu_and_mul(x)
    assert out.shape == (num_rows, intermediate) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOLERANCES[dtype])


def test_dispatch_runs_the_kernels_for_float32_and_bf16_and_the_references_otherwise(built: None) -> None:
    for dtype in DTYPES:
        x = _randn(4, 192, dtype=dtype, seed=1)
        weight = torch.ones(96, dtype=dtype)
        assert torch.equal(silu_and_mul(x), cpu_layer_ops.silu_and_mul(x))
        assert torch.equal(rms_norm(x[:, :96], weight, EPS)[0], cpu_layer_ops.rms_norm(x[:, :96], weight, EPS, None)[0])
    half = _randn(4, 192, dtype=torch.float16, seed=1)
    assert torch.equal(silu_and_mul(half), silu_and_mul_ref(half))
    assert torch.equal(rms_norm(half, torch.ones(192, dtype=torch.float16), EPS)[0],
                       rms_norm_ref(half, torch.ones(192, dtype=torch.float16), EPS)[0])


def test_without_a_compiler_the_references_run(without_a_compiler: None, caplog: pytest.LogCaptureFixture) -> None:
    assert cpu_layer_ops.load() is None
    assert "PyTorch reference" in caplog.text and "no-such-cc" in caplog.text
    x = _randn(3, 128, dtype=torch.float32, seed=2)
    assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))
    q, k, v, positions, slot_mapping = _attention_inputs(2, 4, 2, 64, torch.float32)
    ref_q, _ = apply_rotary_ref(q, k, positions, _cos_sin_cache(64))
    q_out, _ = rotate_and_write_kv(q, k, v, positions, _cos_sin_cache(64), *_caches(2, 64, torch.float32), slot_mapping)
    assert torch.equal(q_out, ref_q) and q_out.data_ptr() != q.data_ptr()
