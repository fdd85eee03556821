from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a process where `import triton` fails, then every kernel used on CPU
WITHOUT_TRITON = """
import sys

class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is not installed")

sys.meta_path.insert(0, NoTriton())
import torch
from kernels import _triton
from kernels.activation import silu_and_mul
from kernels.kv_cache_write import write_kv_cache
from kernels.paged_attention import paged_attention
from kernels.rms_norm import rms_norm, rms_norm_triton
from kernels.rotary import apply_rotary

assert _triton.triton is None and "triton" not in sys.modules
x = torch.randn(2, 64)
rms_norm(x, torch.ones(64), 1e-6)
silu_and_mul(x)
k = torch.randn(2, 1, 64)
apply_rotary(k, k, torch.tensor([0, 1]), torch.zeros(4, 64))
cache = torch.zeros(1, 16, 1, 64)
write_kv_cache(k, k, cache, cache.clone(), torch.tensor([0, 1]))
table = torch.zeros(1, 1, dtype=torch.int32)
paged_attention(k[:1], cache, cache, table, torch.tensor([2], dtype=torch.int32),
                torch.tensor([0, 1], dtype=torch.int32), 1, 0.125)
try:
    rms_norm_triton(x, torch.ones(64), 1e-6)
except RuntimeError as exc:
    print(exc)
"""


def test_cpu_use_works_when_triton_cannot_be_imported() -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "Triton failed to import (ImportError: triton is not installed); "
        "CUDA tensors need it (CPU tensors run the PyTorch references)"
    )
