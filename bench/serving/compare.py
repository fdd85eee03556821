"""Print result documents of several runs side by side.

python -m bench.serving.compare a.json b.json [--labels A,B] [--format markdown]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.serving.report import metric_rows

_CONFIG_KEYS = ("model", "workload", "num_prompts", "request_rate", "max_concurrency")


def comparison_table(labels: list[str], documents: list[dict[str, Any]]) -> list[list[str]]:
    """Header row, then how each run was made and its metrics, one row per label in
    first-seen order; "-" where a run lacks it."""
    columns = [_column(doc) for doc in documents]
    metric_labels = list(dict.fromkeys(label for column in columns for label in column))
    return [["metric", *labels]] + [[name, *(column.get(name, "-") for column in columns)] for name in metric_labels]


def format_text(table: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join(
        "  ".join([row[0].ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True))])
        for row in table
    )


def format_markdown(table: list[list[str]]) -> str:
    header, *body = table
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def _column(document: dict[str, Any]) -> dict[str, str]:
    config = document.get("config", {})
    column = {key: str(config[key]) for key in _CONFIG_KEYS if key in config}
    return column | {label: value for _, label, value in metric_rows(document["metrics"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serving.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("results", nargs="+", type=Path, help="result JSON files written by --result-json")
    parser.add_argument("--labels", help="comma-separated column names (default: file stems)")
    parser.add_argument("--format", choices=("text", "markdown"), default="text")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [path.stem for path in args.results]
    if len(labels) != len(args.results):
        parser.error(f"{len(labels)} labels for {len(args.results)} result files")
    table = comparison_table(labels, [json.loads(path.read_text()) for path in args.results])
    print(format_markdown(table) if args.format == "markdown" else format_text(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
