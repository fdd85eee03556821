"""Worker processes load torch with OpenMP threads that spin only briefly between parallel regions
(services/runtime/omp_wait.py), unless the operator chose otherwise: libgomp says what it read when
it loaded (OMP_DISPLAY_ENV=verbose)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.runtime import omp_wait

SET_THEN_LOAD = "from services.runtime.omp_wait import spin_briefly as s; print(s()); import torch"
LOAD_THEN_SET = "import torch; from services.runtime.omp_wait import spin_briefly as s; s()"


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in omp_wait.OPERATOR_SETTINGS}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env=base | {"OMP_DISPLAY_ENV": "verbose"} | env)


def read_by_libgomp(result: subprocess.CompletedProcess[str], name: str) -> str:
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip().startswith(f"{name} = ")]
    assert lines, f"libgomp printed no {name}:\n{result.stderr[-2000:]}"
    return lines[0].split("=", 1)[1].strip(" '")


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_each_worker_entry_point_loads_torch_spinning_briefly(role: str) -> None:
    # a setting that cannot parse stops the worker right after its imports: torch has loaded by then
    result = run(["-m", f"services.{role}"], LLMD_TORCH_THREADS="not-a-number")
    assert "LLMD_TORCH_THREADS" in result.stderr or "torch_threads" in result.stderr
    assert read_by_libgomp(result, "GOMP_SPINCOUNT") == str(omp_wait.SPIN_COUNT)


def test_the_operators_setting_wins() -> None:
    result = run(["-c", SET_THEN_LOAD], GOMP_SPINCOUNT="300000")
    assert result.stdout.strip() == "False"
    assert read_by_libgomp(result, "GOMP_SPINCOUNT") == "300000"


def test_too_late_once_torch_is_loaded() -> None:
    result = run(["-c", LOAD_THEN_SET])
    assert result.returncode != 0 and "torch is already loaded" in result.stderr
