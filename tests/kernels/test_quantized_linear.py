"""Linear layers over GGUF blocks (kernels/csrc/quantized_linear.c) against their PyTorch reference,
the reference against gguf's own dequantiser, and the model's use of them."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import dequantize as gguf_dequantize

from kernels import quantized_linear as qlin
from kernels.cpu_build import profiled
from kernels.quantized_linear import QuantizedWeight, dequantize, quantized_linear, quantized_linear_ref
from shared.model import linear as linear_module
from shared.model.linear import QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS_BF16, Linear
from shared.model.llama import LlamaModel
from shared.model.loader import LoadedModel
from tests.kernels.c_kernels import cpu_has, require_built

GGML_TYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
FORMATS = list(GGML_TYPES)


@pytest.fixture
def built() -> None:
    """For the tests that call the kernel (the fallback test runs without it)."""
    require_built(qlin.load, "the quantized linear kernel")


def random_blocks(block_format: str, rows: int, in_features: int, seed: int) -> QuantizedWeight:
    """Blocks as a quantiser writes them: random codes, and scales (and Q4_1 minimums) of a
    trained layer's size stored as fp16, a few of them subnormal or negative."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = rows * in_features // qlin.BLOCK
    scales = (torch.rand(num_blocks, 1, generator=gen) * 0.02).half()
    scales[::7] = -scales[::7]
    scales[3::11] = torch.tensor(3e-6, dtype=torch.float16)  # subnormal in fp16
    codes = torch.randint(0, 256, (num_blocks, qlin.BLOCK_BYTES[block_format] - 2 - 2 * (block_format == "q4_1")),
                          dtype=torch.uint8, generator=gen)
    parts = [scales.view(torch.uint8)]
    if block_format == "q4_1":
        parts.append((torch.randn(num_blocks, 1, generator=gen) * 0.05).half().view(torch.uint8))
    blocks = torch.cat([*parts, codes], dim=1).reshape(rows, -1).contiguous()
    return QuantizedWeight(block_format, blocks, in_features)


@pytest.mark.parametrize("block_format", FORMATS)
def test_dequantize_is_bitwise_ggufs_dequantiser(block_format: str) -> None:
    weight = random_blocks(block_format, 24, 96, seed=1)
    expected = gguf_dequantize(weight.blocks.numpy(), GGML_TYPES[block_format])
    assert torch.equal(dequantize(weight), torch.from_numpy(np.asarray(expected, dtype=np.float32)))


# rows: every tile height of the register-widening path (1-4) and of the widened one (3-6: 7 as
# 4 + 3, 8 as 4 + 4, 11 as 6 + 5, 13 as 5 + 4 + 4, 24 as 4 x 6); 7 output rows leave one
# row of weights over, which the plain loop takes; the bias is optional
@pytest.mark.parametrize("block_format", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 11, 13, 24])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("bf16_weights", [False, True])
def test_kernel_matches_the_reference(
    block_format: str, rows: int, with_bias: bool, bf16_weights: bool, built: None
) -> None:
    weight = random_blocks(block_format, 7, 160, seed=rows)
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 160, generator=gen)
    bias = torch.randn(7, generator=gen) if with_bias else None
    out = quantized_linear(x, weight, bias, bf16_weights)
    # the same float32 products summed in another order; rounding the weights to bfloat16 moves
    # them by up to 2**-9 relative, far more than that order, so a missed rounding fails here
    torch.testing.assert_close(out, quantized_linear_ref(x, weight, bias, bf16_weights), atol=1e-5, rtol=1e-5)


def test_kernel_reads_strided_rows_and_a_model_sized_weight(built: None) -> None:
    weight = random_blocks("q4_1", 1536, 576, seed=3)
    x = torch.randn(6, 1000)[:, 100:676]
    assert x.stride() == (1000, 1)
    torch.testing.assert_close(quantized_linear(x, weight, None), quantized_linear_ref(x, weight, None),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("blocks", "in_features", "message"),
    [
        (torch.zeros(4, 40, dtype=torch.uint8), 48, "multiple of 32, got 48"),
        (torch.zeros(4, 41, dtype=torch.uint8), 64, r"uint8 \[rows, 40\], got torch.uint8 \[4, 41\]"),
        (torch.zeros(4, 40, dtype=torch.int8), 64, r"uint8 \[rows, 40\], got torch.int8"),
        (torch.zeros(40, 4, dtype=torch.uint8).t(), 64, r"contiguous uint8 \[rows, 40\]"),
    ],
)
def test_malformed_blocks_are_refused_naming_the_problem(blocks: torch.Tensor, in_features: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QuantizedWeight("q4_1", blocks, in_features)


def test_unknown_formats_and_mixed_stacks_are_refused() -> None:
    with pytest.raises(ValueError, match="'q4_k' is not one of"):
        QuantizedWeight("q4_k", torch.zeros(1, 20, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="cannot stack weights of formats"):
        QuantizedWeight.stack([random_blocks("q4_1", 2, 32, seed=0), random_blocks("q8_0", 2, 32, seed=0)])


def test_inputs_the_kernel_cannot_read_are_refused(built: None) -> None:
    weight = random_blocks("q8_0", 4, 64, seed=0)
    for x in (torch.randn(2, 64, dtype=torch.float64), torch.randn(2, 32), torch.randn(64, 2).t(), torch.randn(64)):
        with pytest.raises(ValueError, match=r"takes float32 \[rows, 64\] with a contiguous last dim"):
            quantized_linear(x, weight, None)


def test_linear_sends_small_products_to_the_blocks_and_large_ones_to_the_float32_weight(
    built: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = random_blocks("q4_1", 64, 128, seed=5)
    layer = Linear(dequantize(weight), None, pack=False, quantized=weight)
    calls = []
    monkeypatch.setattr(qlin, "quantized_linear", lambda *args: calls.append(args) or quantized_linear(*args))
    for rows in (1, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(layer(x), quantized_linear_ref(x, weight, None), atol=1e-5, rtol=1e-5)
    assert [args[0].shape[0] for args in calls] == [1, QUANTIZED_MAX_ROWS]
    with pytest.raises(ValueError, match=r"must have its shape \[64, 96\], got \[64, 128\]"):
        Linear(torch.zeros(64, 96), None, pack=False, quantized=weight)


def test_a_bfloat16_linear_sends_its_smallest_products_to_the_blocks_with_its_own_weights(
    built: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a CPU with AMX (or without AVX512-BF16): the float32 kernel over the rounded weights."""
    monkeypatch.setattr(linear_module, "bf16_kernel_applies", lambda dtype: False)
    weight = random_blocks("q4_1", 64, 128, seed=6)
    layer = Linear(dequantize(weight).bfloat16(), None, pack=False, quantized=weight)
    calls = []
    monkeypatch.setattr(qlin, "quantized_linear", lambda *args, **kwargs: calls.append(kwargs) or quantized_linear(
        *args, **kwargs))
    for rows in (1, QUANTIZED_MAX_ROWS_BF16, QUANTIZED_MAX_ROWS_BF16 + 1):
        x = torch.randn(rows, 128).bfloat16()
        out = layer(x)
        assert out.dtype == torch.bfloat16
        # the bf16 weights in float32 sums either way: equal once rounded, but for a sum on a rounding edge
        expected = quantized_linear_ref(x.float(), weight, None, bf16_weights=True).bfloat16()
        torch.testing.assert_close(out, expected, atol=0, rtol=2**-8)
    assert calls == [{"bf16_weights": True}] * 2


def test_the_default_models_blocks_are_its_float32_weights(loaded_model: LoadedModel) -> None:
    """Every kept block tensor widens to exactly the float32 weight loaded beside it (the q and k
    rows unpermuted alike), so the kernel computes with the model's own weights."""
    formats = {q.format for q in loaded_model.quantized.values()}
    assert formats == {"q4_1", "q8_0"}
    assert len(loaded_model.quantized) == 30 * 7 + 1
    for name, weight in loaded_model.quantized.items():
        assert torch.equal(dequantize(weight), loaded_model.weights[name]), name


def test_the_model_runs_every_linear_layer_from_blocks_in_float32_on_the_cpu(
    loaded_model: LoadedModel, built: None
) -> None:
    model = LlamaModel(loaded_model.config, loaded_model.weights, torch.float32, torch.device("cpu"),
                       loaded_model.quantized)
    layers = [model.lm_head] + [lin for w in model.layers for lin in (w.qkv_proj, w.o_proj, w.gate_up_proj, w.down_proj)]
    assert all(lin.quantized is not None for lin in layers)
    assert model.lm_head.quantized.format == "q8_0"
    # prefill-sized products go to MKL where that is faster; the LM head's never are prefill-sized
    keeps_plain = linear_module.plain_products_faster(torch.float32, torch.device("cpu"))
    assert all((lin.plain is not None) == keeps_plain for lin in layers[1:]) and model.lm_head.plain is None
    x = torch.randn(2, loaded_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    qkv = model.layers[0].qkv_proj
    # sums of 576 products in another order: over 300 random inputs the worst element was 1.6x
    # (1e-5 + 1e-5 * |y|) from the reference, so 3e-5 (random inputs failed 1e-5 2% of the time)
    torch.testing.assert_close(qkv(x), quantized_linear_ref(x, qkv.quantized, None), atol=3e-5, rtol=3e-5)
    bf16 = LlamaModel(loaded_model.config, loaded_model.weights, torch.bfloat16, torch.device("cpu"),
                      loaded_model.quantized)
    bf16_layers = [bf16.lm_head] + [lin for w in bf16.layers for lin in (w.qkv_proj, w.down_proj)]
    assert all(lin.quantized is not None for lin in bf16_layers)


def test_without_a_compiler_the_float32_weights_run(without_a_compiler: None, caplog: pytest.LogCaptureFixture) -> None:
    assert qlin.load() is None
    assert not linear_module.quantized_kernel_available(torch.float32, torch.device("cpu"))
    assert "GGUF blocks" in caplog.text and "no-such-cc" in caplog.text


def test_calls_show_in_the_profiler_only_while_it_records(built: None) -> None:
    from torch.profiler import ProfilerActivity, profile

    weight = random_blocks("q8_0", 4, 64, seed=0)
    x = torch.randn(1, 64)
    assert isinstance(profiled("llmd::quantized_linear"), contextlib.nullcontext)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        quantized_linear(x, weight, None)
    assert "llmd::quantized_linear" in {event.key for event in prof.key_averages()}


@pytest.fixture
def built_bf16() -> None:
    """For the tests of the bfloat16 kernel: it must build wherever the CPU has AVX512-BF16."""
    if not cpu_has("avx512_bf16"):
        pytest.skip("this CPU has no AVX512-BF16")  # the test below checks the kernel is not offered there
    require_built(qlin.load_bf16, "the bfloat16 quantized linear kernel")


def test_the_bf16_kernel_is_offered_exactly_where_the_cpu_has_avx512_bf16(built: None) -> None:
    assert (qlin.load_bf16() is not None) == cpu_has("avx512_bf16")


def bf16_reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return quantized_linear_ref(x.float(), weight, bias, bf16_weights=True).bfloat16()


# rows: every tile height (1-4) and splits into even tiles (5 as 3 + 2, 7 as 4 + 3, 13 as 4 + 3 + 3 + 3);
# 37 output rows: two whole panels of 16 and one of 5, whose last group has one row
@pytest.mark.parametrize("block_format", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_kernel_matches_the_reference(block_format: str, rows: int, with_bias: bool, built_bf16: None) -> None:
    weight = random_blocks(block_format, 37, 160, seed=rows)
    gen = torch.Generator().manual_seed(200 + rows)
    x = torch.randn(rows, 160, generator=gen).bfloat16()
    bias = torch.randn(37, generator=gen) if with_bias else None
    out = qlin.quantized_linear_bf16(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 37)
    # the same float32 products summed in another order, each output rounded once: equal but for a
    # sum on a rounding edge, one bfloat16 step (2**-7 relative at most) apart
    torch.testing.assert_close(out, bf16_reference(x, weight, bias), atol=0, rtol=2**-7)


@pytest.mark.parametrize("block_format", FORMATS)
def test_bf16_kernel_multiplies_by_the_models_bf16_weights_bitwise(block_format: str, built_bf16: None) -> None:
    """Rows of the identity give each weight back, times one and plus exact zeros: every widened
    weight, fp16 subnormal scales and Q4_1 minimums included, is the loader's bfloat16 one."""
    weight = random_blocks(block_format, 33, 64, seed=9)
    out = qlin.quantized_linear_bf16(torch.eye(64).bfloat16(), weight, None)
    assert torch.equal(out.t(), dequantize(weight).bfloat16())


def test_bf16_kernel_reads_strided_rows_of_a_model_sized_weight(built_bf16: None) -> None:
    weight = random_blocks("q4_1", 1536, 576, seed=3)
    x = torch.randn(6, 1000).bfloat16()[:, 100:676]
    assert x.stride() == (1000, 1)
    torch.testing.assert_close(qlin.quantized_linear_bf16(x, weight, None), bf16_reference(x, weight, None),
                               atol=0, rtol=2**-7)


def test_bf16_kernel_refuses_inputs_it_cannot_read(built_bf16: None) -> None:
    weight = random_blocks("q8_0", 4, 64, seed=0)
    for x in (torch.randn(2, 64), torch.randn(2, 32).bfloat16(), torch.randn(64, 2).bfloat16().t()):
        with pytest.raises(ValueError, match=r"takes bfloat16 \[rows, 64\] with a contiguous last dim"):
            qlin.quantized_linear_bf16(x, weight, None)


def test_a_bfloat16_linear_sends_more_rows_to_the_bf16_kernel_on_two_threads_than_on_one(
    built: None, built_bf16: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not linear_module.bf16_kernel_applies(torch.bfloat16):  # AMX: the float32 kernel's test above covers it
        pytest.skip("this CPU has AMX: oneDNN's products run on its tile unit, and the float32 kernel takes 1-3 rows")
    weight = random_blocks("q4_1", 64, 128, seed=6)
    layer = Linear(dequantize(weight).bfloat16(), None, pack=linear_module.onednn_packing_available(
        torch.bfloat16, torch.device("cpu")), quantized=weight)
    calls = []
    kernel = qlin.quantized_linear_bf16
    monkeypatch.setattr(qlin, "quantized_linear_bf16", lambda *args: calls.append(args[0].shape[0]) or kernel(*args))
    threads = torch.get_num_threads()
    one, many = linear_module.BF16_KERNEL_MAX_ROWS_ONE_THREAD, linear_module.BF16_KERNEL_MAX_ROWS
    try:
        for num_threads, row_counts in ((1, (1, one, one + 1)), (2, (one + 1, many, many + 1))):
            torch.set_num_threads(num_threads)
            for rows in row_counts:
                x = torch.randn(rows, 128).bfloat16()
                torch.testing.assert_close(layer(x), bf16_reference(x, weight, None), atol=0, rtol=2**-7)
    finally:
        torch.set_num_threads(threads)
    assert calls == [1, one, one + 1, many]
