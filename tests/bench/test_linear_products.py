"""bench.linear_products on the real model: one row count, both paths, one table row."""

from __future__ import annotations

import re

import pytest

from bench import linear_products
from kernels import quantized_linear
from tests.kernels.c_kernels import require_built


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prints_both_paths_for_each_row_count(dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    require_built(quantized_linear.load, "the quantized linear kernel")
    assert linear_products.main(["--rows", "2,3", "--dtype", dtype]) == 0
    printed = capsys.readouterr().out
    assert "211 matrices, 96 MB of blocks" in printed and f"| rows | blocks ms | {dtype} ms |" in printed
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \|$", printed, re.MULTILINE)
    assert [r[0] for r in rows] == ["2", "3"] and all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
