"""Run Triton kernels on the CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before anything imports triton (transformers does), because
triton.language's own helpers are bound to the interpreter or the compiler at import time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import _triton, cpu_attention, cpu_build, cpu_layer_ops, quantized_linear  # noqa: E402
from kernels.rms_norm import _rms_norm_kernel  # noqa: E402

if _triton.triton is not None and _triton.is_interpreted(_rms_norm_kernel):
    from tests.kernels import interpreter_fixes

    interpreter_fixes.apply()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; runs the compiled Triton kernels")
    config.addinivalue_line("markers", "slow: takes more than about 20 seconds")


@pytest.fixture(scope="session")
def triton_device() -> str:
    """Where the Triton launchers can run here: the CPU interpreter, else the GPU."""
    if _triton.triton is None:
        pytest.fail("triton is not importable, so the kernels cannot be tested")
    kernels_interpreted = _triton.is_interpreted(_rms_norm_kernel)
    if kernels_interpreted and _triton.is_interpreted(_triton.tl.sum):
        return "cpu"
    if not kernels_interpreted and torch.cuda.is_available():
        return "cuda"
    pytest.fail(
        "triton was imported before TRITON_INTERPRET=1 was set, so it is bound to a GPU compiler "
        "while there is no GPU; set TRITON_INTERPRET=1 in the environment or in tests/conftest.py"
    )


@pytest.fixture
def without_a_compiler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> Iterator[None]:
    """`$CC` names no compiler and the kernel cache is empty, so no C kernel can be built; the
    warnings of the attempts are captured in `caplog`."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    loaders = (cpu_attention.load, cpu_attention.load_prefill, cpu_layer_ops.load, quantized_linear.load,
               quantized_linear.load_bf16)
    for load in loaders:
        load.cache_clear()
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        yield
    for load in loaders:
        load.cache_clear()  # the next use loads the real build again
