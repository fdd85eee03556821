"""Compile every kernel launch the launchers make for an H100/H200 (sm_90) without a GPU.

Triton's CPU interpreter accepts code that the real compiler rejects (and ignores shared
memory limits), so the launchers are driven with CPU tensors while `launch` is swapped for
an ahead-of-time compile. Run it as `python -m tests.kernels.sm90_compile` in a process
without TRITON_INTERPRET: under the interpreter, triton.language's own helpers are not
compilable. Prints one JSON line, one entry per distinct compiled kernel.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import _triton
from tests.kernels import launch_cases

SM90 = GPUTarget("cuda", 90, 32)
# Hopper's opt-in shared memory per block
SM90_SHARED_BYTES = 227 * 1024
_OPTION_NAMES = {"num_warps", "num_stages", "enable_fp_fusion"}
_POINTER_TYPES = {
    torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
    torch.int32: "*i32", torch.int64: "*i64",
}


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def compile_launch(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> dict[str, Any]:
    names = kernel.arg_names
    # constexprs come as keywords, so args is shorter than names
    signature = {name: _arg_type(value) for name, value in zip(names, args, strict=False)}
    constexprs = {name: value for name, value in meta.items() if name not in _OPTION_NAMES}
    signature.update({name: "constexpr" for name in constexprs})
    options = {name: value for name, value in meta.items() if name in _OPTION_NAMES}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=SM90, options=options)
    return {"kernel": kernel.fn.__name__, "shared": compiled.metadata.shared, "constexprs": repr(constexprs)}


_DISTINCT: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []


def _compile_nth(index: int) -> dict[str, Any]:
    return compile_launch(*_DISTINCT[index])


def main() -> int:
    launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    _triton.launch = lambda kernel, grid, *args, **meta: launches.append(
        (kernel, args, {**meta, **_triton.LAUNCH_OPTIONS})
    )
    launch_cases.run_all()
    distinct: dict[str, tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}
    for kernel, args, meta in launches:
        distinct.setdefault(f"{kernel.fn.__name__} {[_arg_type(a) for a in args]} {sorted(meta.items())}",
                            (kernel, args, meta))
    _DISTINCT[:] = distinct.values()
    # each compile is single-threaded: one process per core halves the test's minute on two cores;
    # forked, so the children see the launches without pickling the kernels
    with multiprocessing.get_context("fork").Pool(len(os.sched_getaffinity(0))) as pool:
        results = pool.map(_compile_nth, range(len(_DISTINCT)))
    print(json.dumps(results))
    too_big = [r for r in results if r["shared"] > SM90_SHARED_BYTES]
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main())
