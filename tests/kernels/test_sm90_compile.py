from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "_decode_partition_kernel", "_decode_reduce_kernel", "_extend_kernel", "_rms_norm_kernel",
    "_rotary_kernel", "_silu_and_mul_kernel", "_write_kv_cache_kernel",
}


@pytest.mark.slow
def test_every_kernel_configuration_compiles_for_sm90_within_shared_memory() -> None:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-2000:]
    compiled = json.loads(result.stdout.strip().splitlines()[-1])
    assert {entry["kernel"] for entry in compiled} == KERNELS
    assert all(entry["shared"] <= 227 * 1024 for entry in compiled)
