"""deploy/'s Prometheus files as tests read them: paths, the series of promtool's rule tests,
and the metric names a PromQL expression reads.

`parse_series('name{a="b"}')` -> (name, labels) and `format_series` back; `metric_names(expr)`;
`rule_exprs()` / `dashboard_exprs()` every expression of the alert rules / the Grafana dashboard;
`rule_test_series()` every input series of deploy/prometheus-alerts.test.yml.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RULES = DEPLOY / "prometheus-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana-dashboard.json"

Series = tuple[str, frozenset[tuple[str, str]]]
"""A series: metric name and its labels."""


def parse_series(text: str) -> Series:
    """'name{a="b", c="d"}' (promtool's input_series notation) -> (name, labels)."""
    match = re.fullmatch(r"\s*([A-Za-z_:][\w:]*)\s*(?:\{(.*)\})?\s*", text)
    assert match, f"not a series: {text!r}"
    labels = re.findall(r'(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"', match.group(2) or "")
    return match.group(1), frozenset(labels)


def format_series(series: Series) -> str:
    name, labels = series
    inside = ", ".join(f'{key}="{value}"' for key, value in sorted(labels))
    return f"{name}{{{inside}}}"


_NOT_METRICS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "and", "or", "unless", "inf", "nan",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers outside label matchers, ranges,
    strings and grouping clauses, that are not functions or keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = re.findall(r"(?<![\w:.$])([A-Za-z_:][\w:]*)\b(?!\s*\()", expr)
    return {name for name in names if name.lower() not in _NOT_METRICS}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def rule_test_series() -> list[Series]:
    """Every input series of the checked-in rule tests."""
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    return [parse_series(entry["series"]) for group in tests for entry in group["input_series"]]
