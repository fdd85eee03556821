"""Builds and loads the C kernels of `kernels/csrc/` for the CPU at hand.

A source is compiled on first use with the machine's C compiler (`$CC`, else `cc`), for
this CPU (-march=native), into `${XDG_CACHE_HOME:-~/.cache}/llmd/kernels/`; the file name
carries a hash of the source, the headers beside it, the flags and the CPU, so an edit or another machine builds
afresh. The libraries link the OpenMP runtime that torch has already loaded, so they run on
torch's threads (`torch.set_num_threads` applies). Where no compiler is found or the build
fails, `load_library` logs why and returns None, and the callers run the PyTorch references.
ctypes drops the GIL for a call, so other Python threads run while a kernel works.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kernels.disk_cache import cache_dir, one_builder

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
BASE_COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-c")
# no -ffast-math at link time: it would add crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process when the library loads, and torch's numerics with it
LINK_FLAGS = ("-shared", "-fopenmp")


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor()


def _build(source: Path, compiler: str, extra_flags: tuple[str, ...]) -> Path:
    compile_flags = BASE_COMPILE_FLAGS + extra_flags
    digest = hashlib.sha256()
    # every header beside the source counts: an edit to one that it includes builds afresh
    headers = [header.read_bytes() for header in sorted(source.parent.glob("*.h"))]
    for part in (source.read_bytes(), *headers, compiler.encode(), " ".join(compile_flags + LINK_FLAGS).encode(),
                 _cpu_signature().encode()):
        digest.update(part)
    target = cache_dir("kernels") / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        with one_builder(target, f"compiling {source.name} for this CPU"):
            if not target.exists():  # else built while this process waited
                _compile(source, compiler, compile_flags, target)
    return target


def _compile(source: Path, compiler: str, compile_flags: tuple[str, ...], target: Path) -> None:
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename, so no process ever loads a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp + ".o"
    try:
        compile_ = [compiler, *compile_flags, "-o", obj, str(source)]
        link = [compiler, *LINK_FLAGS, "-o", tmp, obj, "-lm"]
        for command in (compile_, link):
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} exited with {result.returncode}: {result.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    logger.info("compiled %s for this CPU in %.1f s, once (later starts load it from %s)",
                source.name, time.monotonic() - started, target.parent)


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles that torch (oneDNN) multiplies on: where it does, oneDNN's and
    torch's bfloat16 products beat the C kernels that some choices here would otherwise take."""
    is_amx_tile_supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return is_amx_tile_supported is not None and is_amx_tile_supported()


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named `name` while the torch profiler records, else nothing: entering
    one costs 10-50 us even with no profiler on, more than a decode step's kernel call itself."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def load_functions(
    source: Path, extra_flags: tuple[str, ...], what: str, signatures: dict[str, list[type]]
) -> ctypes.CDLL | None:
    """`load_library`, with each named function given its argument types and an int result."""
    lib = load_library(source, extra_flags, what)
    if lib is not None:
        for name, argtypes in signatures.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = ctypes.c_int
    return lib


def load_library(source: Path, extra_flags: tuple[str, ...], what: str) -> ctypes.CDLL | None:
    """`source` compiled with `extra_flags` and loaded; None, with a warning naming `what` falls
    back to the PyTorch reference, where it cannot be built. Callers cache the result."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler (cc, gcc or $CC) found: %s runs the slower PyTorch reference", what)
        return None
    try:
        return ctypes.CDLL(str(_build(source, compiler, extra_flags)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("building %s failed, %s runs the slower PyTorch reference: %s", source, what, exc)
        return None
