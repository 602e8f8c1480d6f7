"""Status: the server's /metrics text into status fields, and conditions' transition bookkeeping."""

from __future__ import annotations

import math

from mambaserve.operator import conditions
from mambaserve.operator.conditions import Condition
from mambaserve.operator.status import PodMetrics, metrics_url, observe, parse_metrics, pod_is_ready

METRICS = """\
# HELP mambaserve_cache_hit_rate Sliding-window prefix cache hit rate.
# TYPE mambaserve_cache_hit_rate gauge
mambaserve_cache_hit_rate 0.75
# HELP mambaserve_sessions_open Open sessions.
# TYPE mambaserve_sessions_open gauge
mambaserve_sessions_open 12.0
# HELP mambaserve_prefix_cache_hit_tokens_total Hit tokens.
# TYPE mambaserve_prefix_cache_hit_tokens_total counter
mambaserve_prefix_cache_hit_tokens_total{tier="gpu"} 300.0
mambaserve_prefix_cache_hit_tokens_total{tier="host"} 20.0
"""


def test_parse_metrics_reads_the_documented_gauges() -> None:
    m = parse_metrics("p0", METRICS)
    assert m == PodMetrics("p0", 0.75, 12)


def test_parse_metrics_tolerates_missing_and_nan() -> None:
    assert parse_metrics("p", "# nothing here\n") == PodMetrics("p", None, None)
    m = parse_metrics("p", "# TYPE mambaserve_cache_hit_rate gauge\nmambaserve_cache_hit_rate NaN\n")
    assert m.cache_hit_rate is None


def test_observe_prefers_metrics_and_falls_back_to_the_workload() -> None:
    workload = {"status": {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 3}}
    o = observe(workload, [PodMetrics("a", 0.5, 3), PodMetrics("b", 0.7, 4)])
    assert (o.replicas, o.ready_replicas, o.source, o.open_sessions) == (3, 2, "metrics", 7)
    assert math.isclose(o.cache_hit_rate, 0.6)
    o = observe(workload, [])
    assert (o.ready_replicas, o.cache_hit_rate, o.open_sessions, o.source) == (2, None, None, "workload")
    assert observe(None, []).replicas == 0


def test_metrics_url_uses_the_declared_port_and_readiness() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 31000}]}]},
           "status": {"podIP": "10.0.0.5", "conditions": [{"type": "Ready", "status": "True"}]}}
    assert metrics_url(pod) == "http://10.0.0.5:31000/metrics"
    assert pod_is_ready(pod)
    assert metrics_url({"status": {"podIP": "fd00::1"}}) == "http://[fd00::1]:30000/metrics"
    assert not pod_is_ready({"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    terminating = {**pod, "metadata": {"name": "p", "deletionTimestamp": "2025-01-01T00:00:00Z"}}
    assert not pod_is_ready(terminating)


def test_condition_transition_time_moves_only_on_status_change() -> None:
    first = conditions.merge([], [Condition("Ready", "False", "ReplicasNotReady", "0/1")], 1, "T1")
    same = conditions.merge(first, [Condition("Ready", "False", "ReplicasNotReady", "0/1 again")], 2, "T2")
    assert same[0]["lastTransitionTime"] == "T1" and same[0]["observedGeneration"] == 2
    flipped = conditions.merge(same, [Condition("Ready", "True", "ReplicasReady", "1/1")], 2, "T3")
    assert flipped[0]["lastTransitionTime"] == "T3"


def test_transitions_become_events() -> None:
    before = conditions.merge([], [Condition("Ready", "False", "ReplicasNotReady", ""),
                                   Condition("Degraded", "False", "AsExpected", "")], 1, "T")
    after = conditions.merge(before, [Condition("Ready", "True", "ReplicasReady", "1/1"),
                                      Condition("Degraded", "False", "AsExpected", "")], 1, "T")
    events = conditions.transitions(before, after)
    assert [(e.type, e.reason) for e in events] == [("Normal", "ReadyTrue")]
    assert conditions.transitions(after, after) == []
    degraded = conditions.merge(after, [Condition("Degraded", "True", "InvalidChild", "boom")], 1, "T")
    assert [(e.type, e.reason) for e in conditions.transitions(after, degraded)] == [("Warning", "DegradedTrue")]
