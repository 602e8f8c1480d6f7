"""Dashboards, alerts and the prometheus-adapter rule against reality: metric names collected from a
live server's and operator's /metrics, PromQL parsed (promql-parser and promtool), alert unit tests
(promtool test rules), and every panel's query answered with data by a real Prometheus that scraped
the live stack under load (tests/charts/live_stack.py)."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from tests.charts.conftest import CHART, DATA, MONITORING_ON, render
from tests.charts.live_stack import LiveStack, exported_names

# Series Prometheus itself writes for every scrape target: not exported by anything we run.
PROMETHEUS_SERIES = {"up"}
# Grafana variables as the test evaluates them: every namespace and session, a rate window of
# several scrapes (the live Prometheus scrapes every second), the CRD's default hit-rate target.
GRAFANA_VARS = {"$namespace": ".*", "$session": ".*", "$__rate_interval": "10s", "$target_hit_rate": "0.5",
                "$target_capacity_miss_ratio": "0.1"}


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))}


def substitute(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, PromQL) of every panel target."""
    return [(name, panel["title"], substitute(t["expr"]))
            for name, dash in dashboards().items() for panel in dash["panels"] for t in panel["targets"]]


def variable_queries() -> list[tuple[str, str, str]]:
    """(dashboard, variable, label_values(...) query) of every query variable."""
    return [(name, var["name"], var["definition"]) for name, dash in dashboards().items()
            for var in dash["templating"]["list"] if var["type"] == "query"]


def alert_rules() -> list[dict[str, Any]]:
    groups = render(MONITORING_ON).one("PrometheusRule")["spec"]["groups"]
    return [rule for group in groups for rule in group["rules"]]


def adapter_queries() -> list[str]:
    """prometheus-adapter's metricsQuery templates, filled in as the adapter does for one pod."""
    rules = yaml.safe_load((CHART / "files" / "prometheus-adapter-rules.yaml").read_text())["rules"]
    out = []
    for rule in rules:
        series = re.search(r"\^(\w+)\$", rule["name"]["matches"]).group(1)
        out.append(rule["metricsQuery"].replace("<<.Series>>", series)
                   .replace("<<.LabelMatchers>>", 'namespace="llm",pod=~".+"').replace("<<.GroupBy>>", "pod"))
    return out


def all_expressions() -> list[tuple[str, str]]:
    exprs = [(f"{d} / {p}", q) for d, p, q in panel_queries()]
    exprs += [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]
    exprs += [(f"adapter rule {i}", q) for i, q in enumerate(adapter_queries())]
    exprs += [(f"{d} / ${v}", re.fullmatch(r"label_values\((.*), \w+\)", q).group(1).replace("$namespace", ".*"))
              for d, v, q in variable_queries()]
    return exprs


def metric_names(expr: str) -> set[str]:
    import promql_parser

    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for m in node.matchers.matchers:
                if m.name == "__name__":
                    names.add(m.value)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_every_expression_parses_and_names_a_metric() -> None:
    exprs = all_expressions()
    assert len(exprs) > 50
    for where, expr in exprs:
        if "vector(" in expr and "mambaserve_" not in expr:
            continue  # the dashboard's constant target line
        assert metric_names(expr), f"{where}: no metric in {expr}"


def test_metric_names_exist_in_what_the_server_and_operator_export(live: LiveStack) -> None:
    server, operator = exported_names(live.server_metrics_text()), exported_names(live.operator_metrics_text())
    assert "mambaserve_prefix_cache_hit_tokens_total" in server and "mambaserve_operator_reconciles_total" in operator
    known = server | operator | PROMETHEUS_SERIES
    used: dict[str, list[str]] = {}
    for where, expr in all_expressions():
        for name in metric_names(expr):
            used.setdefault(name, []).append(where)
    unknown = {name: places for name, places in used.items() if name not in known}
    assert unknown == {}, f"metrics nobody exports: {unknown}"
    # The dashboards and alerts cover every metric family the server exports.
    from prometheus_client.parser import text_string_to_metric_families
    families = {f.name for f in text_string_to_metric_families(live.server_metrics_text())}
    covered = set(used) | {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert families - covered == set()


def _rules_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "rules.yaml"
    groups = render(MONITORING_ON).one("PrometheusRule")["spec"]["groups"]
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def test_promtool_checks_the_alert_rules_and_dashboard_queries(promtool: str, tmp_path: pathlib.Path) -> None:
    rules = _rules_file(tmp_path)
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 11 rules found" in out.stdout
    # Dashboard queries through Prometheus' own parser, as recording rules.
    records = [{"record": f"dashboard:query_{i}", "expr": q} for i, (_, _, q) in enumerate(panel_queries())]
    (tmp_path / "panels.yaml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": records}]}))
    out = subprocess.run([promtool, "check", "rules", str(tmp_path / "panels.yaml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_cover_every_alert(promtool: str, tmp_path: pathlib.Path) -> None:
    _rules_file(tmp_path)
    shutil.copy(DATA / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    out = subprocess.run([promtool, "test", "rules", "alerts_test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    tests = yaml.safe_load((DATA / "alerts_test.yaml").read_text())["tests"]
    fired = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    quiet = {t["alertname"] for case in tests for t in case["alert_rule_test"] if not t["exp_alerts"]}
    names = {r["alert"] for r in alert_rules()}
    assert fired == names and quiet == names


def test_every_panel_query_returns_data_from_prometheus(live: LiveStack) -> None:
    start, end = live.load_started, live.load_ended
    empty = []
    for dashboard, title, expr in panel_queries():
        result = live.prometheus.query_range(expr, start, end, 1)
        values = [float(v) for series in result for _, v in series["values"]]
        if not any(v == v for v in values):  # no series, or only NaN
            empty.append(f"{dashboard} / {title}: {expr}")
    assert empty == []


def test_dashboard_variables_list_the_live_labels(live: LiveStack) -> None:
    for dashboard, var, query in variable_queries():
        selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", query).groups()
        values = live.prometheus.api(f"label/{label}/values", **{"match[]": selector.replace("$namespace", ".*")})
        assert values, f"{dashboard} ${var} lists nothing"
    assert live.prometheus.api("label/mambaserve_io_session/values") == ["chat"]


def test_adapter_rules_serve_the_hpa_metrics_from_prometheus(live: LiveStack) -> None:
    for query in adapter_queries():
        result = live.prometheus.query_range(query, live.load_started, live.load_ended, 1)
        assert result and all(s["metric"].get("pod") for s in result), query
    miss = live.prometheus.query_range(adapter_queries()[0], live.load_started, live.load_ended, 1)
    ratios = [float(v) for s in miss for _, v in s["values"] if v != "NaN"]
    assert ratios and all(0 <= r <= 1 for r in ratios)


def test_alert_rules_evaluate_cleanly_on_live_data(live: LiveStack) -> None:
    groups = live.prometheus.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    # Nothing is wrong with the live stack for long enough to fire (every `for` is minutes).
    assert [r["name"] for r in rules if r["state"] == "firing"] == []


@pytest.mark.parametrize("metric", ["mambaserve_cache_evictions_total", "mambaserve_sessions_closed_total",
                                    "mambaserve_session_restores_total", "mambaserve_requests_rejected_total",
                                    "mambaserve_operator_reconcile_errors_total",
                                    "mambaserve_cache_storage_load_seconds_count"])
def test_the_load_moved_every_counter_the_panels_plot(live: LiveStack, metric: str) -> None:
    """Guards the test above against passing on flat zeros: the load really produced these events."""
    assert live.load.errors == []
    assert float(live.prometheus.query(f"sum({metric})")[0]["value"][1]) > 0


def test_promtool_autoscaling_queries_never_yield_nan(promtool: str, tmp_path: pathlib.Path) -> None:
    """The operator's KEDA query and prometheus-adapter rule over a busy session and an idle one. Idle, a
    ratio of rates is 0/0: NaN, which KEDA and prometheus-adapter read differently by version. The KEDA query
    gives the target instead (the autoscaler's formula then holds the replicas) and the adapter rule no value
    for an idle pod (an HPA without values holds); neither is ever NaN."""
    from mambaserve.operator.builders.autoscaling import adapter_rules, capacity_miss_query
    from mambaserve.operator.spec import parse_session
    from tests.operator.conftest import sample

    def session(name: str) -> Any:
        body = sample("inferencesession-autoscaled")  # targetCapacityMissRatio 0.05
        body["metadata"]["name"] = name
        return parse_session(body)

    rule = adapter_rules()["rules"][0]
    adapter = (rule["metricsQuery"].replace("<<.Series>>", rule["seriesQuery"].split("{")[0])
               .replace("<<.LabelMatchers>>", 'namespace="llm",pod=~".+"').replace("<<.GroupBy>>", "pod"))

    def series(name: str, session_: str, pod: str, values: str) -> dict[str, str]:
        return {"series": f'{name}{{namespace="llm",mambaserve_io_session="{session_}",pod="{pod}"}}', "values": values}

    miss, queried = "mambaserve_prefix_cache_capacity_miss_tokens_total", "mambaserve_prefix_cache_queried_tokens_total"
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [series(miss, "busy", "busy-0", "0+25x20"), series(queried, "busy", "busy-0", "0+100x20"),
                         series(miss, "idle", "idle-0", "30x20"), series(queried, "idle", "idle-0", "900x20")],
        "promql_expr_test": [
            {"expr": capacity_miss_query(session("busy")), "eval_time": "10m",
             "exp_samples": [{"labels": "{}", "value": 0.25}]},
            {"expr": capacity_miss_query(session("idle")), "eval_time": "10m",
             "exp_samples": [{"labels": "{}", "value": 0.05}]},  # the target: hold
            {"expr": capacity_miss_query(session("gone")), "eval_time": "10m",  # no series at all
             "exp_samples": [{"labels": "{}", "value": 0.05}]},
            {"expr": adapter, "eval_time": "10m", "exp_samples": [{"labels": '{pod="busy-0"}', "value": 0.25}]},
        ]}]}
    (tmp_path / "autoscaling_test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", "autoscaling_test.yaml"], cwd=tmp_path, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
