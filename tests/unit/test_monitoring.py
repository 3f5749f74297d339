"""monitoring/: the Grafana dashboard and the Prometheus rules over app/metrics.py's catalogue.

promtool (Debian's `prometheus` package; .ci/run installs it) checks the rules, runs their unit tests
(argus-rules.test.yml) and parses every dashboard query. Without promtool those tests skip, except
under CI (env CI set), where they fail. Every query may name only metrics and labels the catalogue
exports, so renaming a metric or a tag fails here. Offline and fast:

    python -m pytest tests/unit/test_monitoring.py -q
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from app.metrics import _DEFINITIONS

from conftest import missing_dependency

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "monitoring"
DASHBOARD = MONITORING / "grafana" / "argus.json"
RULES = MONITORING / "prometheus" / "argus-rules.yml"
RULE_TESTS = MONITORING / "prometheus" / "argus-rules.test.yml"

# What Prometheus makes itself, with the labels a query may use on it.
PROMETHEUS_SERIES = {"ALERTS": {"alertname", "alertstate"}}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring"}


def exported() -> dict[str, set[str]]:
    """Each name Ray's endpoint shows for the catalogue (`ray_` prefix, Prometheus suffixes), with
    the labels a query may use on it."""
    names = {}
    for name, (kind, _, tags) in _DEFINITIONS.items():
        if kind == "counter":
            names[f"ray_{name}_total"] = set(tags)
        elif kind == "gauge":
            names[f"ray_{name}"] = set(tags)
        else:
            names |= {f"ray_{name}_{part}": set(tags) for part in ("sum", "count")}
            names[f"ray_{name}_bucket"] = {*tags, "le"}
    return names | PROMETHEUS_SERIES


def unknown_names(expr: str) -> list[str]:
    """The metric and label names in a PromQL expression that nothing exports."""
    known = exported()
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery durations
    problems = []
    for name, matchers in re.findall(r"\b([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", text):
        labels = set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
        problems += [f"{name}{{{label}}}" for label in sorted(labels - known.get(name, labels))]
    text = re.sub(r"\{[^}]*\}", "", text)
    grouped = re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    # What is left and not a function call, keyword or number is a metric name.
    names = {n for n in re.findall(r"\b[A-Za-z_:][\w:]*\b(?!\s*\()", text) if n.lower() not in KEYWORDS}
    problems += sorted(names - known.keys())
    used = set().union(*(known.get(n, set()) for n in names))
    for group in grouped:
        problems += [f"by({label})" for label in re.findall(r"\w+", group) if label not in used]
    return problems


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p.get("targets", [])]


def rule_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load(RULES.read_text())
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


def promtool() -> str:
    path = shutil.which("promtool")
    if path:
        return path
    missing_dependency("promtool not installed: .ci/run installs it with Debian's `prometheus` package")


def run_promtool(*args: str, cwd: Path = MONITORING / "prometheus") -> None:
    result = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the catalogue check itself -----------------------------------------------------------


@pytest.mark.parametrize(
    "expr,problems",
    [
        ("sum by (topic) (rate(ray_argus_dlq_records_total[5m]))", []),
        ('sum by (le) (rate(ray_argus_serve_latency_seconds_bucket{model_version="3"}[1m]))', []),
        (
            "max by (topic) (ray_argus_consumer_lag_second) > 5",
            ["ray_argus_consumer_lag_second", "by(topic)"],
        ),
        ("rate(ray_argus_dlq_records[5m])", ["ray_argus_dlq_records"]),  # a counter without _total
        ("sum by (topik) (ray_argus_consumer_lag_seconds)", ["by(topik)"]),
        ('ray_argus_serve_requests_total{code="500"}', ["ray_argus_serve_requests_total{code}"]),
    ],
)
def test_catalogue_check_finds_unknown_metrics_and_labels(expr, problems):
    assert unknown_names(expr) == problems


# --- the dashboard ------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_every_query_names_only_exported_metrics_and_labels(source):
    exprs = dashboard_exprs() if source == "dashboard" else rule_exprs()
    assert exprs
    bad = {title: problems for title, expr in exprs if (problems := unknown_names(expr))}
    assert not bad, f"names app/metrics.py does not export: {bad}"


def test_dashboard_is_importable_grafana_json():
    board = dashboard()
    assert board["uid"] == "argus" and board["title"]
    (variable,) = board["templating"]["list"]
    assert variable == {**variable, "name": "datasource", "type": "datasource", "query": "prometheus"}
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        # Any Prometheus data source can be picked at import: nothing names a fixed uid.
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        grid = panel["gridPos"]
        assert set(grid) == {"x", "y", "w", "h"} and grid["x"] + grid["w"] <= 24, panel["title"]


def test_dashboard_queries_parse_as_promql(tmp_path):
    """promtool parses each query, wrapped as a recording rule (it has no bare-expression check)."""
    rules = {"groups": [{"name": "dashboard", "rules": []}]}
    for index, (_, expr) in enumerate(dashboard_exprs()):
        rules["groups"][0]["rules"].append({"record": f"argus:dashboard_query_{index}", "expr": expr})
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    run_promtool("check", "rules", "dashboard.yml", cwd=tmp_path)


def test_dashboard_charts_latency_quantiles_from_buckets():
    exprs = [e for _, e in dashboard_exprs() if "histogram_quantile" in e]
    assert {re.search(r"histogram_quantile\(([\d.]+)", e).group(1) for e in exprs} == {"0.5", "0.99"}
    assert all("ray_argus_serve_latency_seconds_bucket" in e and "le" in e for e in exprs)


# --- the rules ----------------------------------------------------------------------------


def test_rules_pass_promtool_check():
    run_promtool("check", "rules", RULES.name)


def test_rules_unit_tests_pass():
    """argus-rules.test.yml: each alert fires on its synthetic series and stays quiet beside them."""
    run_promtool("test", "rules", RULE_TESTS.name)


def test_every_alert_has_a_firing_and_a_quiet_case():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [c for t in tests for c in t["alert_rule_test"]]
    for alert, _ in rule_exprs():
        outcomes = {bool(c["exp_alerts"]) for c in cases if c["alertname"] == alert}
        assert outcomes == {True, False}, f"{alert}: needs a case that fires and one that does not"


def test_kustomization_makes_configmaps_from_the_checked_files():
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    # The namespace kuberay/*.yaml's NetworkPolicy lets reach the metrics port.
    assert kustomization["namespace"] == "monitoring"
    files = {f for g in kustomization["configMapGenerator"] for f in g["files"]}
    assert {MONITORING / f for f in files} == {DASHBOARD, RULES}
    (board,) = [g for g in kustomization["configMapGenerator"] if "grafana/argus.json" in g["files"]]
    assert board["options"]["labels"] == {"grafana_dashboard": "1"}
