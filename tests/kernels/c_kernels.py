"""What the tests of the C kernels share: a kernel must build wherever a compiler exists."""

from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Callable

import pytest


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (avx512_bf16, amx_bf16, ...) for this CPU."""
    with open("/proc/cpuinfo") as f:
        return flag in f.read().split()


def require_built(load: Callable[[], ctypes.CDLL | None], what: str) -> None:
    """Fail when a C compiler is present but `load()` could not build `what`; skip only on a
    machine with no compiler at all (the no-compiler fallback tests still run there)."""
    if load() is not None:
        return
    if shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc"):
        pytest.fail(f"a C compiler is present but {what} did not build; see the logged warning")
    pytest.skip(f"no C compiler: {what} cannot be built here")
