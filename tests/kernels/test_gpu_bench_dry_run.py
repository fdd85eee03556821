from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_bench


def test_dry_run_checks_and_times_every_kernel_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_bench.main(["--dry-run", "--out", str(tmp_path)]) == 0

    (path,) = tmp_path.glob("gpu_bench-*-dry-run.json")
    report = json.loads(path.read_text())
    assert report["device"] == "cpu" and report["dtype"] == "torch.float32"
    assert report["copy_bandwidth_gbps"] > 0
    checked = {check["kernel"].split(" ")[0] for check in report["checks"]}
    assert checked == {"paged_attention", "rms_norm", "apply_rotary", "silu_and_mul", "write_kv_cache"}
    assert all(check["ok"] for check in report["checks"])
    shapes = gpu_bench.DRY_RUN_SHAPES
    assert [(r["batch"], r["context"]) for r in report["decode"]] == shapes.decode_points
    assert [(r["num_reqs"], r["prefix"], r["new_tokens"]) for r in report["prefill"]] == shapes.prefill_points
    assert all(r["kv_gbps"] > 0 and r["fraction_of_copy"] > 0 for r in report["decode"])
    assert [r["kernel"] for r in report["elementwise"]] == [
        "rms_norm + residual", "apply_rotary", "silu_and_mul", "write_kv_cache",
    ]
    assert report["model"] == {}  # dry runs leave the model out unless --model is given
    assert "decode batch x context" in capsys.readouterr().out


def test_skip_kernels_times_the_whole_model_alone(tmp_path: Path, model_path: str) -> None:
    assert gpu_bench.main(["--dry-run", "--skip-kernels", "--model", model_path, "--out", str(tmp_path)]) == 0

    (path,) = tmp_path.glob("gpu_bench-*-dry-run.json")
    report = json.loads(path.read_text())
    assert report["checks"] == [] and report["decode"] == [] and report["elementwise"] == []
    plan = gpu_bench.DRY_RUN_MODEL_PLAN
    assert set(report["model"]["decode_step_ms"]) == {str(batch) for batch in plan.batch_sizes}
    assert report["model"]["offline"]["output_tokens"] == plan.offline_prompts * plan.offline_max_tokens


def test_skip_kernels_without_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        gpu_bench.main(["--dry-run", "--skip-kernels", "--out", str(tmp_path)])


def test_prefill_flops_count_each_query_against_its_visible_keys() -> None:
    report = gpu_bench.Report(device="cpu", dtype="torch.float32")
    shapes = gpu_bench.Shapes(
        num_heads=2, num_kv_heads=1, head_dim=64, block_size=16, hidden=64, intermediate=64, num_tokens=4,
        decode_points=[], prefill_points=[(2, 3, 4)], copy_bytes=1024,
    )
    gpu_bench.bench_prefill(report, shapes, gpu_bench.torch.float32, gpu_bench.torch.device("cpu"))
    (row,) = report.prefill
    # per request: 4 new queries see 3 cached keys each, plus 1 + 2 + 3 + 4 new keys
    pairs = 2 * (4 * 3 + 10)
    assert row["tflops"] == pytest.approx(4 * 2 * 64 * pairs / row["ms"] / 1e9)
