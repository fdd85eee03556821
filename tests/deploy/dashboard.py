"""What the Grafana dashboard queries: the PromQL of its panels, and the series each one selects.

A selector's name is matched against the sample names of an exposition as Prometheus stores
them: a histogram's `_bucket` / `_sum` / `_count`, a counter's `_total`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.tools import REPO_ROOT

DASHBOARD = REPO_ROOT / "deploy" / "monitoring" / "grafana" / "dashboards" / "llmd.json"

# Label lists of aggregations and vector matching, and range selectors: no series names inside.
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_RANGES = re.compile(r"\[[^\]]*\]")
# A name, its label matchers if any, and a following "(" if it is a function, not a series.
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?(\s*\()?")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset"})
_JOB = re.compile(r'\bjob\s*(=~?)\s*"([^"]*)"')


@dataclass(frozen=True, slots=True)
class Selector:
    name: str
    jobs: frozenset[str] | None  # the scrape jobs it matches; None: any


def panels() -> list[dict]:
    """Every panel of the dashboard, rows included."""
    return json.loads(DASHBOARD.read_text())["panels"]


def expressions() -> list[str]:
    return [target["expr"] for panel in panels() for target in panel.get("targets", [])]


def selectors(expr: str) -> list[Selector]:
    """The series selectors of one PromQL expression."""
    text = _RANGES.sub("", _LABEL_LISTS.sub("", expr))
    found = []
    for name, matchers, call in _SELECTOR.findall(text):
        if call or name in _KEYWORDS:
            continue
        found.append(Selector(name, _jobs(matchers)))
    return found


def _jobs(matchers: str) -> frozenset[str] | None:
    match = _JOB.search(matchers)
    if match is None:
        return None
    op, value = match.groups()
    assert op == "=" or re.fullmatch(r"[\w|-]+", value), f"job matcher {value!r}: only names joined by | are read"
    return frozenset(value.split("|"))


def missing_series(expositions: dict[str, list[str]]) -> list[str]:
    """Each series the dashboard selects that an exposition of a job it names lacks, as
    'name on job (exposition i)'; `expositions` holds every scraped /metrics text by job.
    A selector without a job matcher must be in every exposition."""
    names = {job: [_sample_names(text) for text in texts] for job, texts in expositions.items()}
    missing = []
    for selector in {s for expr in expressions() for s in selectors(expr)}:
        for job in sorted(selector.jobs or names):
            missing += [f"{selector.name} on {job} ({i})" for i, found in enumerate(names.get(job, [set()]))
                        if selector.name not in found]
    return sorted(missing)


def _sample_names(exposition: str) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(exposition) for sample in family.samples}
