"""Paged attention for float32 and bfloat16 on the CPU, through ctypes: decode requests in
csrc/paged_decode_attention.c, prefill chunks in csrc/paged_prefill_attention.c. The cache may
be in any `kernels.kv_quant` format, which the kernels widen as they read it.

Built on first use for this CPU (see `kernels.cpu_build`); where it cannot be built, `load()`
logs why once and returns None, and the callers run the PyTorch reference.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import CSRC, load_functions, profiled
from kernels.kv_quant import KVFormat, unscaled_format

SOURCE = CSRC / "paged_decode_attention.c"
PREFILL_SOURCE = CSRC / "paged_prefill_attention.c"
# -ffast-math lets gcc vectorise the reductions and call glibc's vector expf; the kernel has
# no infinities or NaNs to lose (it takes its maximum over real scores only)
COMPILE_FLAGS = ("-ffast-math",)

_INT64, _INT32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
_ARGTYPES = [
    _PTR, _INT64, _INT64,  # out, strides (request, head)
    _PTR, _INT64, _INT64,  # q, strides (request, head)
    _PTR, _INT64, _INT64, _INT64,  # k_cache, strides (block, token, head)
    _PTR, _INT64, _INT64, _INT64,  # v_cache, strides (block, token, head)
    _PTR, _INT64, _PTR,  # block_tables, its row stride, seq_lens
    _INT32, _INT32, _INT32, _INT32, _INT32,  # reqs, heads, kv heads, head_dim, block_size
    ctypes.c_float, _INT32, _INT32,  # scale, dtype code, cache format
]
_PREFILL_ARGTYPES = [
    _PTR, _INT64, _INT64,  # out, strides (token, head)
    _PTR, _INT64, _INT64,  # q, strides (token, head)
    _PTR, _INT64, _INT64, _INT64,  # k_cache, strides (block, token, head)
    _PTR, _INT64, _INT64, _INT64,  # v_cache, strides (block, token, head)
    _PTR, _INT64, _PTR, _PTR,  # block_tables, its row stride, seq_lens, query_start_loc
    _INT32, _INT32, _INT32, _INT32, _INT32,  # reqs, heads, kv heads, head_dim, block_size
    ctypes.c_float, _INT32, _INT32, _INT32,  # scale, dtype code, cache format, min_query_len
]
# the kernels' dtype codes; they compute in float32 for both
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# it works on 16 lanes: head_dim and block_size must be multiples of that
LANES = 16
MAX_HEAD_DIM = 256


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None (logged once) where it cannot be built."""
    return load_functions(SOURCE, COMPILE_FLAGS, "CPU decode attention", {
        "paged_decode_attention": _ARGTYPES,
        "paged_decode_attention_uses_amx": [_INT32] * 6,  # head_dim, heads, kv heads, block_size, dtype, format
        "paged_decode_attention_uses_bf16_dot": [_INT32] * 6,  # the same
    })


@functools.cache
def load_prefill() -> ctypes.CDLL | None:
    """The compiled prefill kernel, as `load`."""
    return load_functions(PREFILL_SOURCE, COMPILE_FLAGS, "CPU prefill attention", {
        "paged_prefill_attention": _PREFILL_ARGTYPES,
        "paged_prefill_attention_uses_bf16_dot": [_INT32] * 3,  # head_dim, dtype code, cache format
    })


def prefill_uses_bf16_dot(q: torch.Tensor, k_cache: torch.Tensor, kv_format: KVFormat | None = None) -> bool:
    """Whether `paged_prefill_attention` multiplies this query and cache with AVX512-BF16's dot
    products (bf16 query and cache, head_dim a multiple of 32, a CPU that has them), which take
    the softmax weights rounded to bf16 as PyTorch's bf16 flash attention does; elsewhere it
    keeps float32."""
    lib = load_prefill()
    if lib is None or _unsupported(q, k_cache) is not None:
        return False
    code = _format(k_cache, kv_format).code
    return bool(lib.paged_prefill_attention_uses_bf16_dot(q.shape[-1], DTYPE_CODES[q.dtype], code))


def decode_uses_bf16_dot(q: torch.Tensor, k_cache: torch.Tensor, kv_format: KVFormat | None = None) -> bool:
    """Whether `paged_decode_attention` multiplies this query and cache with AVX512-BF16's dot
    products: a bf16 query and cache with head_dim a multiple of 32, on a CPU that has them and
    does not take the call to AMX (`runs_on_amx`)."""
    return _decode_path_is("paged_decode_attention_uses_bf16_dot", q, k_cache, kv_format)


def runs_on_amx(q: torch.Tensor, k_cache: torch.Tensor, kv_format: KVFormat | None = None) -> bool:
    """Whether `paged_decode_attention` computes this query and cache on the AMX tile unit: a bf16
    query and cache with head_dim 32 or 64 and at most 16 query heads per kv head, on a CPU with
    AMX whose kernel lets this process use it (see the C source)."""
    return _decode_path_is("paged_decode_attention_uses_amx", q, k_cache, kv_format)


def _decode_path_is(
    function: str, q: torch.Tensor, k_cache: torch.Tensor, kv_format: KVFormat | None
) -> bool:
    lib = load()
    if lib is None or _unsupported(q, k_cache) is not None:
        return False
    num_heads, head_dim = q.shape[-2:]
    return bool(getattr(lib, function)(
        head_dim, num_heads, k_cache.shape[2], k_cache.shape[1], DTYPE_CODES[q.dtype],
        _format(k_cache, kv_format).code))


def _format(k_cache: torch.Tensor, kv_format: KVFormat | None) -> KVFormat:
    return kv_format or unscaled_format(k_cache.dtype)


def _unsupported(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why the kernel cannot take these arguments, or None where it can."""
    if q.device.type != "cpu" or q.dtype not in DTYPE_CODES:
        return f"the CPU decode attention kernel takes {list(DTYPE_CODES)} on the CPU, got {q.dtype} on {q.device}"
    head_dim, block_size = q.shape[-1], k_cache.shape[1]
    if head_dim % LANES or head_dim > MAX_HEAD_DIM:
        return f"the CPU decode attention kernel takes head_dim a multiple of {LANES} up to {MAX_HEAD_DIM}, got {head_dim}"
    if block_size % LANES:
        return f"the CPU decode attention kernel takes block_size a multiple of {LANES}, got {block_size}"
    return None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` can take this query and cache, with the kernel built."""
    return _unsupported(q, k_cache) is None and load() is not None


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """One query per request: q [num_reqs, num_heads, head_dim] -> the same shape.

    The arguments are those of `kernels.paged_attention.paged_attention` for a decode batch,
    already checked there; every seq_len must be at least 1.
    """
    kv_format = _format(k_cache, kv_format)
    lib = load()
    if lib is None:
        raise RuntimeError(f"the CPU decode attention kernel is not built (see the warning logged for {SOURCE})")
    if (reason := _unsupported(q, k_cache)) is not None:
        raise ValueError(reason)
    num_reqs, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    q, block_tables, seq_lens = _contiguous_rows(q), _contiguous_rows(block_tables), seq_lens.contiguous()
    with profiled("llmd::paged_decode_attention"):
        failed = lib.paged_decode_attention(
            *_paged_args(out, q, k_cache, v_cache, block_tables), seq_lens.data_ptr(),
            num_reqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale, DTYPE_CODES[q.dtype],
            kv_format.code,
        )
    if failed == 3:
        raise ValueError(
            f"every decode request needs at least one token in the cache, got seq_lens {seq_lens.tolist()}"
        )
    if failed:  # 2 (arguments it does not take) is ruled out above
        raise MemoryError(f"the CPU decode attention kernel could not allocate scratch for {int(seq_lens.max())} keys")
    return out


def prefill_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_prefill_attention` can take this query and cache, with the kernel built."""
    return _unsupported(q, k_cache) is None and load_prefill() is not None


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, out: torch.Tensor,
    min_query_len: int = 1, kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """Requests with at least `min_query_len` query rows, written into `out` (the others' rows are
    left as they are): the packed q [num_tokens, num_heads, head_dim] of
    `kernels.paged_attention.paged_attention`, already checked there."""
    lib = load_prefill()
    if lib is None:
        raise RuntimeError(f"the CPU prefill attention kernel is not built (see the warning logged for {PREFILL_SOURCE})")
    if (reason := _unsupported(q, k_cache)) is not None:
        raise ValueError(reason)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {q.dtype} {list(q.shape)} with a contiguous last dim, got {out.dtype} "
                         f"{list(out.shape)} strides {out.stride()}")
    kv_format = _format(k_cache, kv_format)
    q, block_tables = _contiguous_rows(q), _contiguous_rows(block_tables)
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    with profiled("llmd::paged_prefill_attention"):
        failed = lib.paged_prefill_attention(
            *_paged_args(out, q, k_cache, v_cache, block_tables), seq_lens.data_ptr(), query_start_loc.data_ptr(),
            seq_lens.shape[0], q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], scale,
            DTYPE_CODES[q.dtype], kv_format.code, min_query_len,
        )
    if failed == 2:
        raise ValueError(f"the CPU prefill attention kernel does not take {q.shape[1]} query heads over "
                         f"{k_cache.shape[2]} kv heads (at most 64 a group)")
    if failed:
        raise MemoryError("the CPU prefill attention kernel could not allocate its scratch")
    return out


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _paged_args(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, ...]:
    """The arguments both kernels start with (paged_args.h): out, q, the caches and the block
    table, each a pointer and its strides. The caller keeps the tensors alive through the call,
    q and the table contiguous in their last dim (`_contiguous_rows`); a cache that is not is
    refused by name."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {cache.stride()}")
    return (
        out.data_ptr(), out.stride(0), out.stride(1), q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), *k_cache.stride()[:3], v_cache.data_ptr(), *v_cache.stride()[:3],
        block_tables.data_ptr(), block_tables.stride(0),
    )
