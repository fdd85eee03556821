"""make bench-report: docs/benchmarks.md rendered from result files (fixtures in report_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import machine
from bench.machine import describe_machine, machine_identity
from bench.report.__main__ import MAX_LINES, main
from bench.report.comparisons import COMPARISONS, claimed
from bench.report.model import Target
from bench.report.page import render_page
from bench.report.results import ResultsError, collect, load_results
from tests.bench.report_fixtures import DOCUMENTS, MACHINE, write_results


def render(folder: Path) -> str:
    documents = load_results(folder, claimed)
    return render_page(COMPARISONS, documents, {p.stem for p in folder.glob("*.png")}, "results")


def targets_rows(page: str) -> dict[str, str]:
    """The targets table's goal -> met? cells."""
    block = page.split("## Targets\n\n", 1)[1].split("\n\n", 1)[0]
    return {cells[1].strip(): cells[3].strip() for cells in (row.split("|") for row in block.splitlines()[2:])}


def test_every_comparison_gets_a_section_with_its_command_and_plot(tmp_path: Path) -> None:
    folder = write_results(tmp_path / "results")
    (folder / "interference.png").write_bytes(b"png")
    page = render(folder)
    for comparison in COMPARISONS:
        assert f"\n## {comparison.title}\n" in page
    assert "python -m bench.handoff_redis" in page and "python -m bench.engine" in page
    assert "disaggregated vs colocated: interference](results/interference.png)" in page
    assert "| this stack | 3783 | - | 0.46x |" in page  # overhead's table (a result without runs' ranges)
    assert "Test CPU, 2 cores (avx2), 8 GiB, no GPU; PyTorch 2.13.0, where `dtype=auto` runs float32." in page
    assert page.count("\n") <= MAX_LINES


def test_the_load_each_result_was_written_under_is_shown(tmp_path: Path) -> None:
    write_results(tmp_path, ["engine"], machine=MACHINE | {"load_1m": 5.4})
    write_results(tmp_path, ["routing"], machine=MACHINE | {"load_1m": 1.9})
    assert "times read as rough): engine 5.4, routing 1.9." in render(tmp_path)


def test_the_summary_sets_this_stack_beside_vllm_and_transformers(tmp_path: Path) -> None:
    page = render(write_results(tmp_path))
    assert "| serving, output tok/s (side_by_side) | 150.00 | 140.00 | 22.00 |" in page
    # the side by side's runs' range, where a result kept its runs
    assert "| this stack (1P+1D) | 150.00 | 146.00-155.50 | 20.0 |" in page and "| vLLM CPU 0.32.0 | 140.00 | - |" in page
    assert "| engine alone, output tok/s (engine) | 50.0 | - | 10.0 |" in page


def test_the_same_results_render_the_same_page_whatever_the_files_order(tmp_path: Path) -> None:
    names = list(DOCUMENTS)
    first = render(write_results(tmp_path / "a", names))
    second = render(write_results(tmp_path / "b", names[::-1]))
    assert first == second
    assert render(tmp_path / "a") == first


def test_a_missing_result_leaves_out_its_section_and_targets(tmp_path: Path) -> None:
    page = render(write_results(tmp_path, [n for n in DOCUMENTS if n != "prefix_cache"]))
    assert "Prefix caching" not in page
    assert "prefix_cache" not in page
    assert not any("prefix caching" in goal for goal in targets_rows(page))


def test_no_results_give_a_page_that_says_so(tmp_path: Path) -> None:
    page = render_page(COMPARISONS, {}, set(), "results")
    assert "No results yet" in page and "## Targets" not in page


@pytest.mark.parametrize(("mean_ratio", "met"), [(8.0, "yes"), (2.0, "no")])
def test_a_target_row_says_no_when_its_number_is_below_the_target(tmp_path: Path, mean_ratio: float, met: str) -> None:
    folder = write_results(tmp_path, ["prefix_cache"])
    document = json.loads((folder / "prefix_cache.json").read_text())
    document["ttft_ratio_off_on"]["mean"] = mean_ratio
    (folder / "prefix_cache.json").write_text(json.dumps(document))
    rows = targets_rows(render(folder))
    assert rows == {"prefix caching cuts the mean TTFT at least 3x on a shared-prefix workload": met}


def test_targets_with_a_ceiling_fail_above_it() -> None:
    assert Target("p99 ratio within 1.5x", 1.4, 1.5, "1.40x", higher_is_better=False).met
    assert not Target("p99 ratio within 1.5x", 1.6, 1.5, "1.60x", higher_is_better=False).met


def test_the_targets_come_from_the_results(tmp_path: Path) -> None:
    rows = targets_rows(render(write_results(tmp_path)))
    assert rows["output throughput at least 5x transformers' static batching"] == "yes"  # 150 / 22
    assert rows["goodput under latency targets at least 1.5x vLLM's CPU build"] == "no"  # 1 vs 1 req/s
    handoff = "KV handoff over the socket: the wait left after a 4,096-token prefill at least 5x below Redis's"
    assert rows[handoff] == "yes"  # 8 vs 700 ms
    assert rows["routing: follow-ups' TTFT p50 at least 2x lower than the shared stream"] == "yes"  # 1200 / 575


def test_a_prompt_below_the_stream_minimum_shows_as_a_whole_transfer(tmp_path: Path) -> None:
    page = render(write_results(tmp_path, ["handoff_tcp"]))
    assert "| tcp, whole | 128 |" in page and "| tcp, streamed | 4,096 |" in page


def test_results_of_two_machines_are_refused_naming_the_file(tmp_path: Path) -> None:
    write_results(tmp_path, ["engine"])
    write_results(tmp_path, ["routing"], machine=MACHINE | {"cpu": "Other CPU"})
    with pytest.raises(ResultsError, match=r"routing\.json comes from another machine \(Other CPU"):
        load_results(tmp_path, claimed)


def test_a_machine_is_its_hardware_not_when_or_what_ran_on_it() -> None:
    later = MACHINE | {"date": "2027-01-01", "commit": "def5678", "torch": "2.14.0", "load_1m": 3.0}
    assert machine_identity(later) == machine_identity(MACHINE)
    assert machine_identity(MACHINE | {"isa": ["avx2", "amx_bf16"]}) != machine_identity(MACHINE)


def test_a_result_names_the_code_as_its_benchmark_started(monkeypatch: pytest.MonkeyPatch) -> None:
    # a commit made while a long run goes on (the side by side takes 11 minutes) is not what ran
    monkeypatch.setattr(machine, "_commit", lambda: "c0ffee1")
    assert describe_machine()["commit"] == machine.CODE_AT_START != "c0ffee1"


def test_a_result_without_a_machine_is_refused(tmp_path: Path) -> None:
    (tmp_path / "engine.json").write_text(json.dumps(DOCUMENTS["engine"]))
    with pytest.raises(ResultsError, match=r"engine\.json has no machine description"):
        load_results(tmp_path, claimed)


def test_a_result_of_another_shape_is_named_in_the_error(tmp_path: Path) -> None:
    folder = write_results(tmp_path, ["kv_reservation"])
    document = json.loads((folder / "kv_reservation.json").read_text())
    del document["kv_pool"]
    (folder / "kv_reservation.json").write_text(json.dumps(document))
    with pytest.raises(ResultsError, match=r"kv_reservation\.json: not the shape .* 'kv_pool'"):
        render(folder)


def test_collect_copies_this_machines_results_and_plots_only(tmp_path: Path) -> None:
    source = write_results(tmp_path / "bench", ["engine", "routing"])
    write_results(source, ["kv_dtype"], machine=MACHINE | {"cpu": "Other CPU"})
    (source / "engine.png").write_bytes(b"png")
    (source / "gpu_bench-20261206.json").write_text(json.dumps({"machine": MACHINE}))  # no comparison renders it
    copied = collect(source, tmp_path / "docs", MACHINE, claimed)
    assert sorted(p.name for p in copied) == ["engine.json", "engine.png", "routing.json"]


def test_collect_drops_the_plot_of_an_older_run_that_the_new_one_lacks(tmp_path: Path) -> None:
    target = write_results(tmp_path / "docs", ["engine"])
    (target / "engine.png").write_bytes(b"older run")
    collect(write_results(tmp_path / "bench", ["engine"]), target, MACHINE, claimed)
    assert not (target / "engine.png").exists()


def test_collect_refuses_to_mix_machines_in_the_committed_folder(tmp_path: Path) -> None:
    write_results(tmp_path / "docs", ["engine"], machine=MACHINE | {"cpu": "Other CPU"})
    with pytest.raises(ResultsError, match="holds results of another machine"):
        collect(write_results(tmp_path / "bench", ["routing"]), tmp_path / "docs", MACHINE, claimed)


def test_the_command_collects_and_renders(tmp_path: Path) -> None:
    source = write_results(tmp_path / "bench", ["engine", "prefix_cache"], machine=describe_machine())
    out = tmp_path / "docs" / "benchmarks.md"
    argv = ["--source", str(source), "--results", str(tmp_path / "docs" / "results"), "--out", str(out)]
    assert main([*argv, "--collect"]) == 0
    page = out.read_text()
    assert "## Prefix caching on vs off" in page
    assert main(argv) == 0
    assert out.read_text() == page


def test_the_overhead_targets_come_from_its_table(tmp_path: Path) -> None:
    rows = targets_rows(render(write_results(tmp_path, ["overhead"])))
    # the fixture's stack keeps 3,783 of its engine's 8,267 tok/s; it has no vLLM rows to compare with
    assert rows == {"tiny model: the stack keeps at least 85% of its engine's throughput": "no"}


def test_the_side_by_side_target_against_vllm_gives_both_runs_ranges(tmp_path: Path) -> None:
    write_results(tmp_path, ["side_by_side"])
    document = json.loads((tmp_path / "side_by_side.json").read_text())
    document["runs"]["vLLM CPU 0.32.0"]["output_throughput_runs"] = [120.0, 140.0, 141.0]
    (tmp_path / "side_by_side.json").write_text(json.dumps(document))
    assert ("| 1.07x (side_by_side, random; runs 146.00-155.50 vs 120.00-141.00 tok/s) | yes |"
            in render(tmp_path))


def test_the_overhead_targets_against_vllm_give_the_runs_ranges(tmp_path: Path) -> None:
    rows = [{"row": name, "output_tok_s": median, "output_tok_s_range": span, "share_of_own_engine": None,
             "vs_vllm": None, "cpu_us_per_token": 100.0, "cpu_vs_vllm": None, "client_cpu_us_per_token": None}
            for name, median, span in (("this engine alone", 9000.0, [8500.0, 9400.0]),
                                       ("vLLM engine alone", 3000.0, [2900.0, 3100.0]),
                                       ("this stack", 3600.0, [3400.0, 3900.0]),
                                       ("vLLM server", 3000.0, [2500.0, 3050.0]))]  # fmt: skip
    document = {"table": rows, "sweep": [], "phases": [], "machine": MACHINE, "command": "python -m bench.overhead"}
    (tmp_path / "overhead.json").write_text(json.dumps(document))
    page = render(tmp_path)
    assert "| 3.00x (9,000 vs 3,000 tok/s; runs 8,500-9,400 vs 2,900-3,100) | yes |" in page
    assert "| 1.20x (3,600 vs 3,000 tok/s; runs 3,400-3,900 vs 2,500-3,050) | yes |" in page


def test_the_overhead_share_target_says_the_most_these_cores_allow(tmp_path: Path) -> None:
    page = render(write_results(tmp_path, ["overhead"]))
    # 2 cores over 237 + 70 + 113 + 10 + 60 = 490 µs per token: 4,082 tok/s, 49% of the engine's 8,267
    assert ("| 46%; at most 49% on these 2 cores: the engine alone's 237 CPU µs per token, plus the 193 of the "
            "processes beside the decode worker (prefill-0 70, gateway 113, redis-server 10) and the client's 60 |"
            in page)
