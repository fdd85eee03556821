"""Guarded Triton import and the one place kernels are launched.

CPU-only installs may lack Triton (or have one that fails to import); they run the PyTorch
references, so the kernel modules must still import. `jit` then leaves the kernel a plain
function that nothing calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

IMPORT_ERROR: str | None = None
try:
    import triton
    import triton.language as tl
# a broken install can fail with more than ImportError; CPU use must survive any of them
except Exception as exc:
    triton = None
    tl = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

# FMA contraction is off so that `a * b + c` rounds as in the references. Matrix products are
# unaffected, and the rest of every kernel is memory-bound. Passing it explicitly also keeps
# Triton 3.9 from warning that its default will change.
LAUNCH_OPTIONS: dict[str, Any] = {"enable_fp_fusion": False}


def jit(fn: Callable[..., None]) -> Any:
    return fn if triton is None else triton.jit(fn)


def require_triton() -> None:
    if triton is None:
        raise RuntimeError(
            f"Triton failed to import ({IMPORT_ERROR}); CUDA tensors need it (CPU tensors run the PyTorch references)"
        )


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
