"""make bench-report [ARGS=--collect]: render docs/benchmarks.md from docs/results/ (after copying
this machine's latest bench/results/ there, with --collect)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.machine import describe_machine
from bench.report.comparisons import COMPARISONS, claimed
from bench.report.page import render_page
from bench.report.results import ResultsError, collect, load_results
from bench.result_files import RESULTS_DIR

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 250  # the page is read, not searched: past this, cut a section's table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--collect", action="store_true",
                        help="first copy this machine's results from --source into --results")
    parser.add_argument("--source", type=Path, default=RESULTS_DIR, help="where the benchmarks write")
    parser.add_argument("--results", type=Path, default=REPO / "docs" / "results", help="the committed results")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    try:
        if args.collect:
            copied = collect(args.source, args.results, describe_machine(), claimed)
            for path in copied:
                print(f"collected {path}", file=sys.stderr)
            if not copied:
                print(f"collected nothing: {args.source} holds no results of this machine", file=sys.stderr)
        documents = load_results(args.results, claimed)
    except ResultsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    plots = {path.stem for path in args.results.glob("*.png")}
    link = Path(os.path.relpath(args.results, args.out.parent)).as_posix()
    page = render_page(COMPARISONS, documents, plots, link)
    length = page.count("\n")
    if length > MAX_LINES:
        print(f"error: the page would be {length} lines, over {MAX_LINES}; not written", file=sys.stderr)
        return 1
    args.out.write_text(page)
    print(f"wrote {args.out}: {length} lines from {len(documents)} results", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
