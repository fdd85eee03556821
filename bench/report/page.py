"""docs/benchmarks.md from the result documents: how to regenerate it, the machine, the summary
and targets tables, then one section per comparison that has results. Nothing but the documents
goes in, so the same results give the same page, byte for byte."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

from bench.report.model import Comparison, Documents, Target, table
from bench.report.results import ResultsError

T = TypeVar("T")

HEADER = """# Benchmarks

Generated from docs/results/ by `make bench-report`; do not edit. To refresh: run a benchmark (`make bench-engine`,
...; each writes bench/results/<name>.json), then `make bench-report ARGS=--collect` copies this machine's latest
results into docs/results/ and renders this page. TTFT, TPOT and ITL: [benchmarking.md](benchmarking.md)."""


def render_page(
    comparisons: Sequence[Comparison], documents: Documents, plots: Collection[str], results_link: str
) -> str:
    """The page for `documents` (result name -> JSON); `plots` names the results that have a PNG,
    linked as `results_link`/<name>.png."""
    present = [(c, {name: doc for name, doc in documents.items() if c.claims(name)}) for c in comparisons]
    present = [(c, docs) for c, docs in present if docs]
    lines = [HEADER, ""]
    if not present:
        return "\n".join([*lines, "No results yet: run a benchmark, then `make bench-report ARGS=--collect`.", ""])
    lines += ["## The machine", "", machine_line(next(iter(documents.values()))["machine"]), "",
              _provenance(documents), ""]
    summary = [row for c, docs in present for row in _checked(c, docs, c.summary)]
    if summary:
        lines += ["## Summary", ""]
        lines += table(["measure", "this stack", "vLLM CPU build", "transformers"],
                       [[r.measure, r.ours, r.vllm, r.transformers] for r in summary])
        lines.append("")
    targets = [t for c, docs in present for t in _checked(c, docs, c.targets)]
    if targets:
        lines += ["## Targets", ""]
        lines += targets_table(targets)
        lines.append("")
    for comparison, docs in present:
        lines += section(comparison, docs, plots, results_link)
    return "\n".join(lines)


def machine_line(machine: dict[str, Any]) -> str:
    isa = ", ".join(machine.get("isa") or []) or "none of AVX2, AVX-512, AMX"
    return (f"{machine['cpu']}, {machine['cores']} cores ({isa}), {machine.get('memory_gib', '?')} GiB, "
            f"{machine.get('gpu') or 'no GPU'}; PyTorch {machine['torch']}, where `dtype=auto` runs "
            f"{machine['auto_dtype']}.")


def targets_table(targets: Sequence[Target]) -> list[str]:
    return table(["target", "measured", "met?"], [[t.goal, t.measured, "yes" if t.met else "no"] for t in targets],
                 text_columns=3)


def section(comparison: Comparison, docs: Documents, plots: Collection[str], results_link: str) -> list[str]:
    lines = [f"## {comparison.title}", "", comparison.what, "", "```bash"]
    lines += [doc.get("command", f"# {name}.json does not record its command") for name, doc in docs.items()]
    lines += ["```", ""]
    lines += _checked(comparison, docs, comparison.body)
    lines += [""] + [f"![{comparison.title}: {name}]({results_link}/{name}.png)" for name in docs if name in plots]
    if lines[-1]:
        lines.append("")
    return lines


def _provenance(documents: Documents) -> str:
    dates = sorted({doc["machine"].get("date") or "?" for doc in documents.values()})
    commits = sorted({doc["machine"].get("commit") or "?" for doc in documents.values()})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    line = f"Results of {when}, at commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}."
    loads = {name: doc["machine"]["load_1m"] for name, doc in documents.items() if "load_1m" in doc["machine"]}
    if loads:
        cores = next(iter(documents.values()))["machine"]["cores"]
        line += (f" The 1-minute load average as each was written ({cores} cores; above that, other work shared "
                 f"them and times read as rough): {', '.join(f'{name} {load:g}' for name, load in loads.items())}.")
    return line


def _checked(comparison: Comparison, docs: Documents, render: Callable[[Documents], list[T]]) -> list[T]:
    """`render(docs)`, with a result file of another shape (an older benchmark's) named in the error."""
    try:
        return render(docs)
    except (KeyError, TypeError, IndexError, AttributeError) as error:
        raise ResultsError(f"{', '.join(f'{name}.json' for name in docs)}: not the shape the {comparison.prefix} "
                           f"renderer reads ({type(error).__name__}: {error}); rerun the benchmark") from error
