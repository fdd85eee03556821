"""The KV cache's storage formats: the model's dtype, a 16-bit float, or 8 bits with scales.

A scaled (8-bit) cache stores each token's key or value row of one kv head as head_dim codes
followed by that row's float32 scale, all as bytes (the pool is uint8):

    k_cache[block, slot, kv_head] = [ c_0 c_1 ... c_{d-1} | scale (float32, native order) ]
    x_i ~= decode(c_i) * scale,   scale = max_i |x_i| / FORMAT_MAX   (1 where the row is all zeros)

A scale per row (token and kv head), the finest the issue allows, rather than per block: every
write is then complete the moment it lands, with nothing to clip; a block-wide scale set by a
block's first token either clips the later tokens that exceed it or leaves headroom that costs
every token precision (`make bench-kv-dtype` measures both). It costs 4 bytes a row: a 64-wide
head takes 68 bytes, 3.76x fewer than float32 rather than 4x. Because the scales sit inside the
rows, a block's bytes are self-contained: the prefix cache, `Engine.read_blocks` /
`write_blocks` and every KV transport move them as they are, never a widened copy.

Codes round to nearest even, as torch's conversions do (the C and Triton writers match this
reference bit for bit); the format's largest magnitude maps to the row's largest |x|, so
nothing overflows. The kernels decode fp8 by bit manipulation and int8 by a multiply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import _triton
from kernels._triton import tl

SCALE_BYTES = 4  # one float32 per row


@dataclass(frozen=True, slots=True)
class KVFormat:
    name: str  # as LLMD_KV_CACHE__DTYPE spells it
    code: int  # the C kernels' cache code (kernels/csrc/lanes.h, KV_*)
    dtype: torch.dtype  # what one value is stored as
    max_value: float | None = None  # scaled formats: the largest code's magnitude

    @property
    def is_scaled(self) -> bool:
        return self.max_value is not None

    @property
    def storage_dtype(self) -> torch.dtype:
        """The pool tensor's dtype: bytes for scaled formats (codes and scales side by side)."""
        return torch.uint8 if self.is_scaled else self.dtype

    def row_elements(self, head_dim: int) -> int:
        """Elements (of `storage_dtype`) one kv head's row of one token takes in the pool."""
        return head_dim + SCALE_BYTES if self.is_scaled else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_elements(head_dim) * self.storage_dtype.itemsize


FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("float32", 0, torch.float32),
    KVFormat("bfloat16", 1, torch.bfloat16),
    KVFormat("float16", 2, torch.float16),
    KVFormat("fp8_e4m3", 3, torch.float8_e4m3fn, 448.0),
    KVFormat("fp8_e5m2", 4, torch.float8_e5m2, 57344.0),
    KVFormat("int8", 5, torch.int8, 127.0),
)}


def kv_format(name: str, model_dtype: torch.dtype) -> KVFormat:
    """The format a `kv_cache.dtype` setting names; 'auto' is the model's dtype."""
    key = str(model_dtype).removeprefix("torch.") if name == "auto" else name
    if key not in FORMATS:
        raise ValueError(f"KV cache dtype {name!r} is not one of {['auto', *FORMATS]}")
    return FORMATS[key]


def unscaled_format(dtype: torch.dtype) -> KVFormat:
    """The format of a cache tensor that holds plain values of `dtype`."""
    for fmt in FORMATS.values():
        if not fmt.is_scaled and fmt.dtype == dtype:
            return fmt
    raise ValueError(f"a KV cache of dtype {dtype} needs its format named (8-bit caches are stored as uint8)")


def quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Rows x [..., head_dim] -> uint8 [..., head_dim + 4]: codes, then the row's float32 scale."""
    assert fmt.max_value is not None, f"{fmt.name} is not a scaled format"
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)  # [..., 1]
    scale = torch.where(amax > 0, amax / fmt.max_value, 1.0)
    # amax / scale can round to just above the format's maximum: clamp before the conversion
    scaled = (xf / scale).clamp(-fmt.max_value, fmt.max_value)
    codes = scaled.round().to(torch.int8) if fmt.dtype == torch.int8 else scaled.to(fmt.dtype)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows [..., head_dim + 4] (from `quantize`) -> values [..., head_dim] in `dtype`."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :head_dim].contiguous().view(fmt.dtype).float()
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (codes * scale).to(dtype)


def triton_constants(fmt: KVFormat) -> dict[str, object]:
    """What the Triton kernels take of a format, as constexprs: its code (KV), whether it is
    scaled, and the fp8 codes' mantissa bits, exponent bias and smallest subnormal step."""
    mant, bias = {"fp8_e4m3": (3, 7), "fp8_e5m2": (2, 15)}.get(fmt.name, (0, 0))
    return {"KV": fmt.code, "SCALED": fmt.is_scaled, "KV_MAX": fmt.max_value or 0.0, "KV_MANT": mant,
            "KV_BIAS": bias, "KV_SUB_STEP": 2.0 ** (1 - bias - mant)}


@_triton.jit
def _round_to_integer(x):
    """Small float32 x rounded to the nearest integer, ties to even, as torch rounds. (Adding
    and taking away 2**23 would do it in float32, but Triton's interpreter computes that sum in
    float64.)"""
    up = tl.floor(x + 0.5)
    return tl.where((up - x == 0.5) & ((up.to(tl.int32) & 1) == 1), up - 1.0, up)


@_triton.jit
def triton_encode(x, KV: tl.constexpr, KV_MAX: tl.constexpr, KV_MANT: tl.constexpr, KV_BIAS: tl.constexpr):
    """Float32 values already divided by their row's scale -> int32 codes (0 .. 255) of an 8-bit
    format (see triton_constants), rounded to nearest even as torch converts: the value's count
    of steps of its binade (the lowest binade's step below it), which is the code once the
    binade's exponent is added."""
    x = tl.minimum(tl.maximum(x, -KV_MAX), KV_MAX)
    if KV == 5:
        return _round_to_integer(x).to(tl.int32) & 0xFF
    a = tl.abs(x)
    binade = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 1 - KV_BIAS)
    step = ((binade - KV_MANT + 127) << 23).to(tl.float32, bitcast=True)
    steps = _round_to_integer(a / step).to(tl.int32)
    sign = tl.where(x < 0, 0x80, 0)
    return (((binade + KV_BIAS - 1) << KV_MANT) + steps) | sign


@_triton.jit
def triton_decode(codes, KV: tl.constexpr, KV_MANT: tl.constexpr, KV_BIAS: tl.constexpr, KV_SUB_STEP: tl.constexpr):
    """int32 codes (0 .. 255) of an 8-bit format -> float32, before the row's scale."""
    if KV == 5:
        return tl.where(codes > 127, codes - 256, codes).to(tl.float32)
    magnitude = codes & 0x7F
    normal = ((magnitude << (23 - KV_MANT)) + ((127 - KV_BIAS) << 23)).to(tl.float32, bitcast=True)
    value = tl.where((magnitude >> KV_MANT) == 0, magnitude.to(tl.float32) * KV_SUB_STEP, normal)
    return tl.where(codes >= 0x80, -value, value)


@_triton.jit
def triton_store_rows(ptr, rows, x, offs_d, mask, row_mask, HEAD_DIM: tl.constexpr, SCALED: tl.constexpr,
                      KV: tl.constexpr, KV_MAX: tl.constexpr, KV_MANT: tl.constexpr, KV_BIAS: tl.constexpr):
    """Rows x [N, D] (masked entries 0) stored at element offsets `rows` [N] of a cache, as
    `quantize` / `to_cache` store them."""
    if SCALED:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, amax / KV_MAX, 1.0)
        codes = triton_encode(x / scale[:, None], KV, KV_MAX, KV_MANT, KV_BIAS)
        tl.store(ptr + rows[:, None] + offs_d[None, :], codes.to(tl.uint8), mask=mask)
        tl.store((ptr + rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale, mask=row_mask)
    else:
        tl.store(ptr + rows[:, None] + offs_d[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@_triton.jit
def triton_load_rows(ptr, rows, offs_d, mask, row_mask, HEAD_DIM: tl.constexpr, SCALED: tl.constexpr,
                     KV: tl.constexpr, KV_MANT: tl.constexpr, KV_BIAS: tl.constexpr, KV_SUB_STEP: tl.constexpr):
    """Cache rows starting at element offsets `rows` [N], dims offs_d [D], as float32 [N, D]
    (8-bit codes times their row's scale); masked entries read 0."""
    if SCALED:
        codes = tl.load(ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0).to(tl.int32)
        scale = tl.load((ptr + rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=row_mask, other=0.0)
        return triton_decode(codes, KV, KV_MANT, KV_BIAS, KV_SUB_STEP) * scale[:, None]
    return tl.load(ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)


def to_cache(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Rows x [..., head_dim] as the cache stores them."""
    if fmt.dtype == torch.float16 and x.dtype != torch.float16:  # wider values would become inf
        return x.float().clamp(-65504.0, 65504.0).to(torch.float16)
    return quantize(x, fmt) if fmt.is_scaled else x.to(fmt.dtype)


def from_cache(rows: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows back as values [..., head_dim] in `dtype` (no copy where they already are)."""
    return dequantize(rows, fmt, dtype) if fmt.is_scaled else rows.to(dtype)
