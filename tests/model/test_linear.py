from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model.linear import PLAIN_MIN_ROWS, Linear, onednn_packing_available, plain_products_faster

CPU = torch.device("cpu")


def test_packing_is_offered_for_float32_and_for_bf16_only_where_onednn_has_it() -> None:
    assert onednn_packing_available(torch.float32, CPU) == torch.backends.mkldnn.is_available()
    assert onednn_packing_available(torch.bfloat16, CPU) == (
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    assert not onednn_packing_available(torch.float16, CPU)
    assert not onednn_packing_available(torch.float32, torch.device("meta"))


# bf16: the packed product rounds its float32 sum once, like F.linear, but sums in another
# order: a bf16 ulp at most
TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2**-7}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_as_the_model_builds_it_matches_f_linear(dtype: torch.dtype, rows: int, bias: bool) -> None:
    # packed wherever the model would pack it (always for float32 here; bf16 where native), else plain
    pack = onednn_packing_available(dtype, CPU)
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 48, generator=gen) / 7).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 48, generator=gen).to(dtype)
    linear = Linear(weight.clone(), b, pack=pack)
    assert linear.packed == pack and linear.out_features == 96
    out = linear(x)
    assert out.dtype == dtype and out.shape == (rows, 96)
    torch.testing.assert_close(out, F.linear(x, weight, b), **TOLERANCES[dtype])
    assert torch.equal(Linear(weight, b, pack=False)(x), F.linear(x, weight, b))


def test_plain_products_are_offered_for_float32_on_avx2_only() -> None:
    avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert plain_products_faster(torch.float32, CPU) == (avx2 and onednn_packing_available(torch.float32, CPU))
    assert not plain_products_faster(torch.bfloat16, CPU)
    assert not plain_products_faster(torch.float32, torch.device("meta"))


@pytest.mark.parametrize("bias", [False, True])
def test_a_kept_plain_weight_takes_prefill_sized_products_and_the_packed_one_the_rest(
    bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # where oneDNN cannot pack, the weight is plain already and every product is F.linear's
    pack = onednn_packing_available(torch.float32, CPU)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 48, generator=gen) / 7
    b = torch.randn(96, generator=gen) if bias else None
    linear = Linear(weight.clone(), b, pack=pack, keep_plain=True)
    assert linear.packed == pack and (torch.equal(linear.plain, weight) if pack else linear.plain is None)
    extra = weight.numel() * 4 if pack else 0
    assert linear.num_bytes() == Linear(weight.clone(), b, pack=pack).num_bytes() + extra
    plain_rows = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, *args: plain_rows.append(x.shape[0]) or real_linear(x, *args))
    all_rows = [1, PLAIN_MIN_ROWS - 1, PLAIN_MIN_ROWS, 2 * PLAIN_MIN_ROWS]
    for rows in all_rows:
        x = torch.randn(rows, 48, generator=gen)
        torch.testing.assert_close(linear(x), real_linear(x, weight, b), **TOLERANCES[torch.float32])
    assert plain_rows == ([PLAIN_MIN_ROWS, 2 * PLAIN_MIN_ROWS] if pack else all_rows)
    assert Linear(weight.clone(), b, pack=False, keep_plain=True).plain is None  # unpacked: the weight is plain
