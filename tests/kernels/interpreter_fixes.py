"""Make Triton 3.9's CPU interpreter treat bf16 the way NVIDIA GPUs do.

The interpreter keeps bf16 as raw uint16. It truncates fp32 -> bf16 where GPUs round to
nearest even, and its tl.dot multiplies bf16 tiles as those raw integers. Both are
interpreter bugs, not kernel behaviour, so they are fixed here rather than worked around in
the kernels; everything else about the interpreter is left alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def _bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _fp32_to_bf16_bits_rne(values: np.ndarray) -> np.ndarray:
    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def apply() -> None:
    builder = interpreter.InterpreterBuilder
    cast_impl, create_dot = builder.cast_impl, builder.create_dot

    def rounding_cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_bits_rne(src.data), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    def bf16_create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.dtype.scalar == tl.bfloat16:
            a = interpreter.TensorHandle(_bf16_bits_to_fp32(a.data), tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = interpreter.TensorHandle(_bf16_bits_to_fp32(b.data), tl.float32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.cast_impl = rounding_cast_impl
    builder.create_dot = bf16_create_dot
