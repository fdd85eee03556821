from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import cpu_attention
from kernels.paged_attention import (
    paged_attention,
    paged_attention_cpu,
    paged_attention_ref,
    paged_attention_triton,
)
from tests.kernels.c_kernels import cpu_has, require_built
from tests.kernels.paged_batch import PagedBatch, dense_causal_attention, make_paged_batch

# (seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size)
Case = tuple[list[int], list[int], int, int, int, int]

DECODE_CASES: list[Case] = [
    ([1], [1], 4, 4, 64, 16),  # a single token
    ([1, 15, 16, 17, 33], [1] * 5, 6, 2, 64, 16),  # around block boundaries, 3 queries per kv head
    ([31, 32, 33, 70], [1] * 4, 8, 1, 128, 32),  # 8 queries per kv head
    ([100, 3], [1, 1], 2, 2, 128, 16),
]
# decode batches long enough to be split into several partitions
SPLIT_DECODE_CASES: list[Case] = [
    ([1, 200, 65], [1] * 3, 6, 2, 64, 32),  # short and long requests together
    ([130, 7], [1, 1], 8, 1, 128, 16),
]
EXTEND_CASES: list[Case] = [
    ([20], [20], 4, 4, 64, 16),  # a fresh prompt
    ([50], [13], 6, 2, 64, 16),  # prefill on a cached prefix that ends mid-block
    ([1, 40, 77], [1, 40, 30], 3, 1, 64, 32),  # decode, fresh prompt and cached prefix in one batch
    ([70, 18], [70, 5], 8, 1, 64, 16),  # queries span two fp32 query tiles, 8 queries per kv head
    ([24, 9], [10, 9], 2, 2, 128, 32),
    ([140], [135], 2, 1, 64, 32),  # queries span two bf16 query tiles
]
DTYPES = [torch.float32, torch.bfloat16]
# fp32: both sides compute in fp32, summing in different orders (measured <= 1e-6).
# bf16: the kernel rounds probabilities to bf16 for the PV product and both round the output
# to bf16, whose ulp is 2**-7 in [1, 2): two ulps (measured <= one).
TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}


def _case_id(case: Case) -> str:
    seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size = case
    return f"seq{seq_lens}-q{query_lens}-h{num_heads}/{num_kv_heads}-d{head_dim}-bs{block_size}".replace(" ", "")


def _batch(case: Case, dtype: torch.dtype, device: str = "cpu") -> PagedBatch:
    return make_paged_batch(*case, dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES + SPLIT_DECODE_CASES + EXTEND_CASES, ids=_case_id)
def test_ref_matches_dense_causal_attention(case: Case, dtype: torch.dtype) -> None:
    batch = _batch(case, dtype)
    out = paged_attention_ref(*batch.args)
    assert out.dtype == dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.double(), dense_causal_attention(batch), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES + EXTEND_CASES, ids=_case_id)
def test_triton_matches_ref(case: Case, dtype: torch.dtype, triton_device: str) -> None:
    batch = _batch(case, dtype, triton_device)
    out = paged_attention_triton(*batch.args)
    assert out.dtype == dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out, paged_attention_ref(*batch.args), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SPLIT_DECODE_CASES, ids=_case_id)
def test_split_decode_matches_ref(case: Case, dtype: torch.dtype, triton_device: str) -> None:
    batch = _batch(case, dtype, triton_device)
    out = paged_attention_triton(*batch.args, partition_size=64)
    torch.testing.assert_close(out, paged_attention_ref(*batch.args), **TOLERANCES[dtype])


def test_split_decode_equals_single_partition_decode(triton_device: str) -> None:
    batch = _batch(([150, 64, 1], [1, 1, 1], 4, 2, 64, 16), torch.float32, triton_device)
    split = paged_attention_triton(*batch.args, partition_size=64)
    whole = paged_attention_triton(*batch.args, partition_size=256)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)


@pytest.fixture
def cpu_kernel() -> None:
    """The C kernels must build wherever a compiler exists; without one the reference runs."""
    require_built(cpu_attention.load, "the CPU attention kernel")
    require_built(cpu_attention.load_prefill, "the CPU prefill attention kernel")


# head_dim 80 takes the kernel's generic path; 64 and 128 its specialised ones (and on a CPU
# with AMX, bf16 head_dim 32 and 64 its tile path; with AVX512-BF16, bf16 96 and 256 the dot
# path's generic copy)
CPU_EXTRA_CASES: list[Case] = [
    ([5, 90, 33], [1] * 3, 10, 2, 80, 16), ([300, 1, 47], [1, 1, 1], 9, 3, 64, 16), ([40, 17], [1, 1], 4, 2, 32, 16),
    ([37, 2], [1, 1], 6, 2, 96, 16), ([40, 3], [1, 1], 4, 2, 256, 16),
]
# prefill chunks over the prefill kernel's work items (64 query tokens) and key blocks (64
# keys; 16-key tiles on bf16 dot products): several items, a cached prefix ending mid-block, one
# key past two whole blocks, row counts that are not whole micro-tiles of 6 rows (or of the dot
# path's groups: 8 rows at head_dim 32, 4 at 64, 2 at 96 and 128, 1 at 256), head_dim 80
CPU_EXTEND_CASES: list[Case] = [
    ([150, 1, 64], [150, 1, 64], 9, 3, 64, 16),
    ([129, 64], [129, 60], 9, 3, 64, 16),
    ([203, 70], [131, 2], 6, 2, 80, 32),
    ([33], [5], 1, 1, 32, 16),
    ([90, 37], [75, 37], 3, 1, 96, 16),
    ([50], [41], 2, 2, 256, 16),
]
CPU_CASES = DECODE_CASES + SPLIT_DECODE_CASES + EXTEND_CASES + CPU_EXTRA_CASES + CPU_EXTEND_CASES


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_cpu_kernel_matches_ref(case: Case, cpu_kernel: None) -> None:
    batch = _batch(case, torch.float32)
    out = paged_attention_cpu(*batch.args)
    assert out.dtype == torch.float32 and out.shape == batch.q.shape
    torch.testing.assert_close(out, paged_attention_ref(*batch.args), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_cpu_kernel_in_bf16_is_the_float32_result_rounded(case: Case, cpu_kernel: None) -> None:
    batch = _batch(case, torch.bfloat16)
    out = paged_attention_cpu(*batch.args)
    assert out.dtype == torch.bfloat16 and out.shape == batch.q.shape
    # the same bf16 values attended in float32: both kernels only round the output, so they sit
    # within one bf16 ulp (2**-8 relative) of this, closer than the bf16 reference gets
    upcast = [t.float() if t.is_floating_point() else t for t in batch.args[:-3]]
    exact = paged_attention_ref(*upcast, *batch.args[-3:-1])
    # rows of prefill requests on bf16 dot products took their weights rounded to bf16, as the
    # reference (SDPA's bf16 flash attention) and the Triton kernel do: held to the bf16 bound
    rounded_weights = batch.max_query_len > 1 and cpu_attention.prefill_uses_bf16_dot(batch.q, batch.k_cache)
    decode_rows = (batch.query_start_loc.diff() == 1).nonzero().squeeze(1)
    rows = batch.query_start_loc[decode_rows].long() if rounded_weights else torch.arange(out.shape[0])
    torch.testing.assert_close(out[rows].float(), exact[rows], atol=1e-3, rtol=2**-8)
    torch.testing.assert_close(out, paged_attention_ref(*batch.args), **TOLERANCES[torch.bfloat16])


def test_bf16_prefill_runs_on_dot_products_exactly_where_the_cpu_has_them(cpu_kernel: None) -> None:
    batch = _batch(EXTEND_CASES[0], torch.bfloat16)
    assert cpu_attention.prefill_uses_bf16_dot(batch.q, batch.k_cache) == cpu_has("avx512_bf16")
    assert not cpu_attention.prefill_uses_bf16_dot(batch.q.float(), batch.k_cache.float())
    odd = _batch(([20], [20], 4, 2, 80, 16), torch.bfloat16)  # head_dim 80: not whole 32-lane pairs
    assert not cpu_attention.prefill_uses_bf16_dot(odd.q, odd.k_cache)


def _decode_shape(head_dim: int, num_heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode query of one request and a cache of 3 kv heads: what the path checks read."""
    return torch.zeros(1, num_heads, head_dim, dtype=dtype), torch.zeros(2, 16, 3, head_dim, dtype=dtype)


def test_bf16_decode_runs_on_amx_exactly_where_the_cpu_has_it(cpu_kernel: None) -> None:
    has_amx = cpu_has("amx_bf16")
    assert cpu_attention.runs_on_amx(*_decode_shape(64, 9, torch.bfloat16)) == has_amx  # SmolLM2's attention
    assert cpu_attention.runs_on_amx(*_decode_shape(32, 6, torch.bfloat16)) == has_amx
    assert not cpu_attention.runs_on_amx(*_decode_shape(64, 9, torch.float32))
    assert not cpu_attention.runs_on_amx(*_decode_shape(128, 9, torch.bfloat16))  # more output tiles than AMX has
    assert not cpu_attention.runs_on_amx(*_decode_shape(64, 3 * 17, torch.bfloat16))  # 17 query heads per kv head


def test_bf16_decode_runs_on_dot_products_where_the_cpu_has_them_and_amx_does_not_take_it(cpu_kernel: None) -> None:
    has_dot = cpu_has("avx512_bf16")
    for head_dim, num_heads in ((64, 9), (128, 9), (32, 6), (64, 3 * 17)):
        q, k_cache = _decode_shape(head_dim, num_heads, torch.bfloat16)
        expected = has_dot and not cpu_attention.runs_on_amx(q, k_cache)
        assert cpu_attention.decode_uses_bf16_dot(q, k_cache) == expected, (head_dim, num_heads)
    assert not cpu_attention.decode_uses_bf16_dot(*_decode_shape(64, 9, torch.float32))
    assert not cpu_attention.decode_uses_bf16_dot(*_decode_shape(80, 9, torch.bfloat16))  # not whole 32-lane pairs


@pytest.mark.parametrize("dtype", DTYPES)
def test_slots_past_a_requests_end_cannot_reach_its_output(dtype: torch.dtype, cpu_kernel: None) -> None:
    # an unwritten slot's value times a zero probability: 0 * inf would be NaN
    batch = _batch(([21, 5], [1, 1], 9, 3, 64, 16), dtype)
    clean = paged_attention_cpu(*batch.args)
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        last_block = int(batch.block_tables[i, (seq_len - 1) // 16])
        batch.k_cache[last_block, seq_len % 16 :] = float("inf")
        batch.v_cache[last_block, seq_len % 16 :] = float("inf")
    assert torch.equal(paged_attention_cpu(*batch.args), clean)


def test_the_tile_unit_is_left_as_the_caller_had_it(cpu_kernel: None) -> None:
    # oneDNN's bf16 products use the tile unit on the same threads, between attention calls
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(256, 576, generator=gen).bfloat16() for _ in range(2))
    before = torch.nn.functional.linear(x, w)
    batch = _batch(CPU_EXTRA_CASES[1], torch.bfloat16)
    paged_attention_cpu(*batch.args)
    assert torch.equal(torch.nn.functional.linear(x, w), before)


def test_loading_the_cpu_kernel_leaves_subnormals_alone(cpu_kernel: None) -> None:
    # a library linked with -ffast-math would turn on flush-to-zero for the whole process
    assert 1e-310 * 1.0 != 0.0
    tiny = torch.tensor([1e-38], dtype=torch.float32) / 1e3
    assert tiny.item() != 0.0


def test_cpu_kernel_reads_strided_queries(cpu_kernel: None) -> None:
    batch = _batch(DECODE_CASES[1], torch.float32)
    # q as the model makes it: one head's slice of a wider projection, so rows are not packed
    wide = torch.cat([batch.q, torch.randn_like(batch.q)], dim=2)
    out = cpu_attention.paged_decode_attention(
        wide[:, :, : batch.q.shape[2]], batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.scale
    )
    torch.testing.assert_close(out, paged_attention_ref(*batch.args), **TOLERANCES[torch.float32])


def test_cpu_dispatch_runs_the_kernel_for_float32_and_bf16_and_the_reference_otherwise(cpu_kernel: None) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        batch = _batch(EXTEND_CASES[2], dtype)
        assert torch.equal(paged_attention(*batch.args), paged_attention_cpu(*batch.args))
    fp16 = _batch(EXTEND_CASES[2], torch.float16)
    assert torch.equal(paged_attention(*fp16.args), paged_attention_ref(*fp16.args))


def test_without_a_compiler_the_reference_runs(without_a_compiler: None, caplog: pytest.LogCaptureFixture) -> None:
    assert cpu_attention.load() is None
    assert "PyTorch reference" in caplog.text and "no-such-cc" in caplog.text
    batch = _batch(DECODE_CASES[1], torch.float32)
    assert torch.equal(paged_attention(*batch.args), paged_attention_ref(*batch.args))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (([5, 20], [1, 1], 4, 2, 72, 16), "head_dim a multiple of 16 up to 256, got 72"),
        (([5, 20], [1, 1], 4, 2, 64, 8), "block_size a multiple of 16, got 8"),
    ],
)
def test_shapes_the_cpu_kernel_does_not_take_run_the_reference(case: Case, message: str, cpu_kernel: None) -> None:
    batch = _batch(case, torch.float32)
    assert torch.equal(paged_attention(*batch.args), paged_attention_ref(*batch.args))
    with pytest.raises(ValueError, match=message):
        cpu_attention.paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.scale
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_kernel_writes_only_the_rows_of_long_enough_requests(dtype: torch.dtype, cpu_kernel: None) -> None:
    batch = _batch(EXTEND_CASES[2], dtype)  # query rows 1, 40 and 30
    out = torch.full_like(batch.q, 7.0)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    cpu_attention.paged_prefill_attention(*args, batch.scale, out, min_query_len=2)
    assert torch.equal(out[0], torch.full_like(out[0], 7.0))  # the decode request's row: the decode kernel's
    torch.testing.assert_close(out[1:], paged_attention_ref(*batch.args)[1:], **TOLERANCES[dtype])


def test_prefill_kernel_refuses_what_it_does_not_take(cpu_kernel: None) -> None:
    batch = _batch(([20], [20], 65, 1, 64, 16), torch.float32)  # 65 query heads on one kv head
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    with pytest.raises(ValueError, match="65 query heads over 1 kv heads"):
        cpu_attention.paged_prefill_attention(*args, batch.scale, torch.empty_like(batch.q))
    with pytest.raises(ValueError, match="out must be torch.float32 \\[20, 65, 64\\]"):
        cpu_attention.paged_prefill_attention(*args, batch.scale, torch.empty(20, 65, 32))


def test_cpu_kernel_rejects_an_empty_context(cpu_kernel: None) -> None:
    batch = _batch(DECODE_CASES[1], torch.float32)
    seq_lens = batch.seq_lens.clone()
    seq_lens[2] = 0
    with pytest.raises(ValueError, match="at least one token"):
        cpu_attention.paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, batch.scale
        )


def test_empty_batch_returns_empty_output() -> None:
    batch = _batch(([5], [1], 2, 2, 64, 16), torch.float32)
    batch.q = batch.q[:0]
    batch.seq_lens = batch.seq_lens[:0]
    batch.query_start_loc = batch.query_start_loc[:1]
    batch.block_tables = batch.block_tables[:0]
    assert paged_attention(*batch.args).shape == (0, 2, 64)


def _hf_sdpa(batch: PagedBatch, rows: list[int]) -> torch.Tensor:
    """transformers' own SDPA attention on contiguous K/V, as it runs with no padding mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    num_heads, num_kv_heads = batch.q.shape[1], batch.k_cache.shape[2]
    module = SimpleNamespace(num_key_value_groups=num_heads // num_kv_heads, is_causal=True)
    starts = batch.query_start_loc.tolist()
    query = torch.stack([batch.q[starts[i] : starts[i + 1]].transpose(0, 1) for i in rows])  # [b, h, q, d]
    key = torch.stack([batch.dense_k[i].transpose(0, 1) for i in rows])  # [b, kv_heads, seq, d]
    value = torch.stack([batch.dense_v[i].transpose(0, 1) for i in rows])
    out, _ = sdpa_attention_forward(module, query, key, value, None, scaling=batch.scale)
    return out.flatten(0, 1)  # [b * q, h, d]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [
        ([37], [1], 6, 2, 64, 16),  # decode, batch 1
        ([45, 45, 45], [1, 1, 1], 8, 1, 128, 32),  # decode, equal lengths
        ([29], [29], 6, 2, 64, 16),  # a fresh prompt
        ([21], [21], 4, 4, 128, 16),
    ],
    ids=_case_id,
)
def test_ref_is_bitwise_hf_sdpa_where_hf_runs_unpadded(case: Case, dtype: torch.dtype) -> None:
    batch = _batch(case, dtype)
    assert torch.equal(paged_attention_ref(*batch.args), _hf_sdpa(batch, list(range(len(case[0])))))


def test_mixed_length_decode_is_close_to_hf_sdpa_per_request() -> None:
    batch = _batch(([3, 64, 100, 17], [1] * 4, 6, 2, 64, 16), torch.float32)
    hf = torch.cat([_hf_sdpa(batch, [i]) for i in range(4)])
    torch.testing.assert_close(paged_attention(*batch.args), hf, atol=1e-6, rtol=1e-6)


def _bad(batch: PagedBatch, **changes: object) -> tuple[object, ...]:
    fields = {
        "q": batch.q, "k_cache": batch.k_cache, "v_cache": batch.v_cache, "block_tables": batch.block_tables,
        "seq_lens": batch.seq_lens, "query_start_loc": batch.query_start_loc,
        "max_query_len": batch.max_query_len, "scale": batch.scale,
    }
    return tuple({**fields, **changes}.values())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"seq_lens": torch.tensor([1, 15], dtype=torch.int64)}, "seq_lens must be int32"),
        ({"query_start_loc": torch.tensor([0, 1], dtype=torch.int32)}, "query_start_loc must be int32 \\[3\\]"),
        ({"q": torch.zeros(2, 5, 64)}, "num_heads 5 is not a multiple of num_kv_heads 2"),
        ({"q": torch.zeros(2, 6, 32)}, "cache rows of 64 do not hold q's head_dim 32 in float32"),
        ({"q": torch.zeros(2, 6, 64, dtype=torch.int32)}, "q must be float32, bfloat16 or float16"),
        ({"v_cache": torch.zeros(5, 16, 2, 64, dtype=torch.bfloat16)}, "stored as torch.float32"),
        ({"q": torch.zeros(3, 6, 64)}, "one query per request: 3 != 2"),
        ({"max_query_len": 0}, "max_query_len must be at least 1"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(changes: dict[str, object], message: str) -> None:
    batch = _batch(([1, 15], [1, 1], 6, 2, 64, 16), torch.float32)
    with pytest.raises(ValueError, match=message):
        paged_attention(*_bad(batch, **changes))
