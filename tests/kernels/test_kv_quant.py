"""The KV cache formats (kernels/kv_quant.py): the round trip within each format's error bound,
and every kernel that reads or writes the cache (C, and Triton under the interpreter on the CPU)
against its reference in each format."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention, cpu_layer_ops
from kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref, write_kv_cache_triton
from kernels.kv_quant import FORMATS, SCALE_BYTES, KVFormat, dequantize, from_cache, kv_format, quantize, to_cache
from kernels.paged_attention import paged_attention, paged_attention_cpu, paged_attention_ref, paged_attention_triton
from kernels.rotary import apply_rotary_ref
from shared.model.rotary import cos_sin_cache
from tests.kernels.c_kernels import require_built
from tests.kernels.paged_batch import dense_causal_attention, in_kv_format, make_paged_batch

SCALED = [f for f in FORMATS.values() if f.is_scaled]
# mantissa bits and smallest normal exponent of each scaled format's codes
CODE_BITS = {"fp8_e4m3": (3, -6), "fp8_e5m2": (2, -14)}
MODEL_DTYPES = [torch.float32, torch.bfloat16]
# a float32 model over each cache format, and a bf16 one over the formats narrower than it
PAIRS = [(torch.float32, f) for f in FORMATS.values()] + [(torch.bfloat16, f) for f in SCALED]
# (seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size)
DECODE = ([1, 15, 16, 17, 70], [1] * 5, 9, 3, 64, 16)
EXTEND = ([1, 40, 77, 140], [1, 40, 30, 135], 6, 2, 64, 16)
SPLIT_DECODE = ([1, 200, 65], [1] * 3, 6, 2, 64, 32)
# float32 queries: kernel and reference read the same dequantised values and differ by summation
# order; bf16 queries: the reference rounds the dequantised K/V to bf16, the kernel keeps float32
TOLERANCES = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 2.4e-2, "rtol": 2.4e-2}}


@pytest.fixture
def cpu_kernel() -> None:
    """The C kernels must build wherever a compiler exists."""
    require_built(cpu_attention.load, "the CPU attention kernel")
    require_built(cpu_attention.load_prefill, "the CPU prefill attention kernel")
    require_built(cpu_layer_ops.load, "the CPU layer kernels")


def _pair_id(pair: tuple[torch.dtype, KVFormat]) -> str:
    return f"{str(pair[0]).removeprefix('torch.')}-over-{pair[1].name}"


def _rows(seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, one all zeros, one with subnormal-sized entries."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, 64, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]
    x[5] = 0
    x[6, 0, :4] = torch.tensor([1.0, 1e-6, -3e-5, 2e-9])
    return x


@pytest.mark.parametrize("fmt", SCALED, ids=lambda f: f.name)
def test_round_trip_stays_within_the_formats_error_bound(fmt: KVFormat) -> None:
    x = _rows()
    rows = quantize(x, fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (64, 3, 64 + SCALE_BYTES)
    back = dequantize(rows, fmt, torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / fmt.max_value
    if fmt.name == "int8":
        bound = 0.5 * scale  # half a step of the row's grid
    else:
        mant, min_exp = CODE_BITS[fmt.name]
        # half an ulp of the code, relative; below the normal range, half the subnormal step
        bound = torch.maximum(x.abs() * 2.0 ** -(mant + 1), scale * 2.0 ** (min_exp - mant - 1))
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(back[5], torch.zeros(3, 64))  # an all-zero row stays exactly zero
    # the row's largest magnitude is a code's largest magnitude times the scale: nothing clips
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", [FORMATS["bfloat16"], FORMATS["float16"]], ids=lambda f: f.name)
def test_16_bit_formats_store_the_values_rounded(fmt: KVFormat) -> None:
    x = _rows()[10:40]  # within float16's range
    assert torch.equal(to_cache(x, fmt), x.to(fmt.dtype))
    assert torch.equal(from_cache(to_cache(x, fmt), fmt, torch.float32), x.to(fmt.dtype).float())


def test_auto_is_the_models_dtype_and_unknown_names_are_refused() -> None:
    assert kv_format("auto", torch.bfloat16) is FORMATS["bfloat16"]
    assert kv_format("int8", torch.float32).row_bytes(64) == 68
    with pytest.raises(ValueError, match="'fp4'"):
        kv_format("fp4", torch.float32)


@pytest.mark.parametrize("model_dtype", MODEL_DTYPES)
@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.name)
def test_c_rotary_cache_write_matches_the_reference_bit_for_bit(
    fmt: KVFormat, model_dtype: torch.dtype, cpu_kernel: None
) -> None:
    gen = torch.Generator().manual_seed(1)
    n, heads, kv_heads, head_dim = 37, 9, 3, 64
    q = (torch.randn(n, heads, head_dim, generator=gen) * 4).to(model_dtype)
    k = (torch.randn(n, kv_heads, head_dim, generator=gen) * 4).to(model_dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(model_dtype)
    k[3] = 0
    positions = torch.randint(0, 256, (n,), generator=gen)
    slots = torch.randperm(10 * 16, generator=gen)[:n]
    cos_sin = cos_sin_cache(head_dim, 10000.0, None, 256)
    caches = [torch.zeros((10, 16, kv_heads, fmt.row_elements(head_dim)), dtype=fmt.storage_dtype) for _ in range(4)]
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cos_sin)
    write_kv_cache_ref(k_ref, v, caches[2], caches[3], slots, fmt)
    cpu_layer_ops.rotate_and_write_kv(q, k, v, positions, cos_sin, caches[0], caches[1], slots, fmt)
    assert torch.equal(q, q_ref)
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("case", [DECODE, EXTEND], ids=["decode", "extend"])
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_c_attention_matches_the_reference_in_each_format(
    pair: tuple[torch.dtype, KVFormat], case: tuple, cpu_kernel: None
) -> None:
    model_dtype, fmt = pair
    batch = in_kv_format(make_paged_batch(*case, dtype=model_dtype), fmt)
    ref = paged_attention_ref(*batch.args)
    assert torch.equal(paged_attention(*batch.args), paged_attention_cpu(*batch.args))
    torch.testing.assert_close(paged_attention_cpu(*batch.args), ref, **TOLERANCES[model_dtype])
    # and the reference is attention over what the cache reads back as
    torch.testing.assert_close(ref.double(), dense_causal_attention(batch), **TOLERANCES[model_dtype])


@pytest.mark.parametrize("model_dtype", MODEL_DTYPES)
@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.name)
def test_triton_cache_write_matches_the_reference_bit_for_bit(
    fmt: KVFormat, model_dtype: torch.dtype, triton_device: str
) -> None:
    gen = torch.Generator().manual_seed(2)
    key = (torch.randn(7, 3, 64, generator=gen) * 5).to(model_dtype)
    value = torch.randn(7, 3, 64, generator=gen).to(model_dtype)
    key[2] = 0
    key[4, 1, :3] = torch.tensor([1e-6, -2e-5, 3e-9])  # codes below the fp8 formats' normal range
    slots = torch.tensor([0, 15, 16, 40, 3, 77, 90])
    caches = [torch.zeros((6, 16, 3, fmt.row_elements(64)), dtype=fmt.storage_dtype) for _ in range(4)]
    ours = [c.to(triton_device) for c in caches[:2]]
    write_kv_cache_triton(key.to(triton_device), value.to(triton_device), *ours, slots.to(triton_device), fmt)
    write_kv_cache_ref(key, value, caches[2], caches[3], slots, fmt)
    for mine, ref in zip(ours, caches[2:]):
        assert torch.equal(mine.cpu().view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("case", [SPLIT_DECODE, EXTEND], ids=["decode", "extend"])
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_triton_attention_matches_the_reference_in_each_format(
    pair: tuple[torch.dtype, KVFormat], case: tuple, triton_device: str
) -> None:
    model_dtype, fmt = pair
    batch = in_kv_format(make_paged_batch(*case, dtype=model_dtype), fmt)
    ref = paged_attention_ref(*batch.args)
    on_device = in_kv_format(make_paged_batch(*case, dtype=model_dtype, device=triton_device), fmt)
    out = paged_attention_triton(*on_device.args, partition_size=64)  # decode: split-K over several partitions
    torch.testing.assert_close(out.cpu(), ref, **TOLERANCES[model_dtype])


def test_kernels_say_which_paths_an_8_bit_cache_takes(cpu_kernel: None) -> None:
    batch = in_kv_format(make_paged_batch(*EXTEND, dtype=torch.bfloat16), FORMATS["int8"])
    # the bf16 dot products and AMX take bf16 caches only; an 8-bit one is widened to float32
    assert not cpu_attention.prefill_uses_bf16_dot(batch.q, batch.k_cache, batch.kv_format)
    assert not cpu_attention.runs_on_amx(batch.q, batch.k_cache, batch.kv_format)


def test_a_cache_not_stored_as_its_format_is_refused() -> None:
    key = torch.randn(2, 2, 64)
    wrong = torch.zeros(4, 16, 2, 64 + SCALE_BYTES)  # float32, where int8 rows are bytes
    with pytest.raises(ValueError, match="stored as torch.uint8"):
        write_kv_cache(key, key, wrong, wrong.clone(), torch.tensor([0, 1]), FORMATS["int8"])
    batch = make_paged_batch(*DECODE, dtype=torch.float32)
    with pytest.raises(ValueError, match="do not hold q's head_dim 64 in int8"):
        paged_attention(*batch.args[:-1], FORMATS["int8"])
