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


def to_cache(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Rows x [..., head_dim] as the cache stores them."""
    if fmt.dtype == torch.float16 and x.dtype != torch.float16:  # wider values would become inf
        return x.float().clamp(-65504.0, 65504.0).to(torch.float16)
    return quantize(x, fmt) if fmt.is_scaled else x.to(fmt.dtype)


def from_cache(rows: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows back as values [..., head_dim] in `dtype` (no copy where they already are)."""
    return dequantize(rows, fmt, dtype) if fmt.is_scaled else rows.to(dtype)
