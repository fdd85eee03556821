"""Guarded Triton import and the one place kernels are launched.

CPU-only installs may lack Triton (or have one that fails to import); they run the PyTorch
references, so the kernel modules must still import. `jit` then leaves the kernel a plain
function that nothing calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

# FMA contraction is off so that `a * b + c` rounds like the references do; these kernels are
# memory-bound and lose nothing by it. Passing it explicitly also keeps Triton 3.9 from
# warning about the default changing.
LAUNCH_OPTIONS: dict[str, Any] = {"enable_fp_fusion": False}

Launcher = Callable[..., None]


def jit(fn: Callable[..., None]) -> Any:
    return fn if triton is None else triton.jit(fn)


def require_triton() -> None:
    if triton is None:
        raise RuntimeError("Triton is not importable; CUDA tensors need it (CPU tensors run the PyTorch references)")


def launch(kernel: Any, grid: Sequence[int], *args: Any, **meta: Any) -> None:
    """Launch `kernel` over `grid`; tests swap this out to compile kernels for a GPU they lack."""
    require_triton()
    kernel[tuple(grid)](*args, **meta, **LAUNCH_OPTIONS)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_interpreted(kernel: Any) -> bool:
    """Whether `kernel` runs on Triton's CPU interpreter (TRITON_INTERPRET=1 when it was defined)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)
