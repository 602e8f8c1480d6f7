"""Autoscaling on capacity misses: an HPA (through prometheus-adapter) or a KEDA ScaledObject.

Both target the server workload (Deployment or StatefulSet) itself, so scaling goes on while the
operator is down; the operator then leaves the workload's replicas to the autoscaler (server-side apply
without the field, kube.py hands it over). They are rendered only where the metrics flow (the reconciler
checks, metrics_flow.py): with no series, KEDA reads 0 and an HPA nothing.

The signal is the *capacity-miss ratio*: prompt tokens whose prefix had been cached and was evicted
for space (``mambaserve_prefix_cache_capacity_miss_tokens_total``), over all prompt tokens looked
up. More replicas mean more aggregate cache, which turns exactly those misses into hits. The raw
miss ratio also counts compulsory misses (prefixes never seen): traffic of fresh prompts misses
whatever the cache size, and scaling on it buys GPUs that cannot help. The ratio is above its
target (``targetCapacityMissRatio``) while the cache is too small for the reuse the traffic has.
Queue depth (optional) is the second signal: more replicas also help when requests wait.

Both signals come from the server pods, so with no pods there is no signal: scaling from zero is
refused by the CRD (``minReplicas`` >= 1 with autoscaling) instead of never waking up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.settings import OperatorSettings
from mambaserve.operator.spec import Autoscaling, InferenceSession

CAPACITY_MISS_METRIC = "mambaserve_cache_capacity_miss_ratio"
QUEUE_METRIC = "mambaserve_num_waiting_requests"
# Server counters (docs/server-interface.md).
_CAPACITY_MISSES = "mambaserve_prefix_cache_capacity_miss_tokens_total"
_QUERIED = "mambaserve_prefix_cache_queried_tokens_total"
RATE_WINDOW = "2m"


def _target(workload: Mapping[str, Any]) -> dict[str, str]:
    return {"apiVersion": workload["apiVersion"], "kind": workload["kind"], "name": workload["metadata"]["name"]}


def _milli(value: float) -> str:
    return f"{round(value * 1000)}m"


def _behavior(scaling: Autoscaling) -> dict[str, Any]:
    def rules(b: Any) -> dict[str, Any]:
        return {
            "stabilizationWindowSeconds": b.stabilization_window_seconds,
            "selectPolicy": "Max",
            "policies": [{"type": "Pods", "value": b.pods, "periodSeconds": b.period_seconds}],
        }
    return {"scaleUp": rules(scaling.scale_up), "scaleDown": rules(scaling.scale_down)}


def build_hpa(session: InferenceSession, workload: Mapping[str, Any]) -> dict[str, Any]:
    scaling = session.autoscaling
    metrics: list[dict[str, Any]] = [{
        "type": "Pods",
        "pods": {
            "metric": {"name": CAPACITY_MISS_METRIC},
            "target": {"type": "AverageValue", "averageValue": _milli(scaling.target_capacity_miss_ratio)},
        },
    }]
    if scaling.target_queue_depth is not None:
        metrics.append({
            "type": "Pods",
            "pods": {
                "metric": {"name": QUEUE_METRIC},
                "target": {"type": "AverageValue", "averageValue": str(scaling.target_queue_depth)},
            },
        })
    obj = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": session_metadata(session, session.name, "autoscaler"),
        "spec": {
            "scaleTargetRef": _target(workload),
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": metrics,
            "behavior": _behavior(scaling),
        },
    }
    return names.stamp(obj)


def series_selector(session: InferenceSession) -> str:
    # ServiceMonitor.podTargetLabels copies the session label onto every scraped series.
    label = names.SESSION_LABEL.replace(".", "_").replace("/", "_").replace("-", "_")
    return f'namespace="{session.namespace}",{label}="{session.name}"'


def capacity_miss_query(session: InferenceSession) -> str:
    """The session's capacity-miss ratio. Never NaN: without queries (0/0) it is the target itself, which
    the autoscaler's formula (replicas x value / target) reads as "hold", as it does within its tolerance."""
    sel = series_selector(session)
    return (f"(sum(rate({_CAPACITY_MISSES}{{{sel}}}[{RATE_WINDOW}])) / "
            f"(sum(rate({_QUERIED}{{{sel}}}[{RATE_WINDOW}])) > 0)) "
            f"or vector({session.autoscaling.target_capacity_miss_ratio:g})")


def queue_query(session: InferenceSession) -> str:
    return f"sum({QUEUE_METRIC}{{{series_selector(session)}}})"


def build_scaled_object(session: InferenceSession, workload: Mapping[str, Any],
                        settings: OperatorSettings) -> dict[str, Any]:
    scaling = session.autoscaling
    address = scaling.prometheus_address or settings.prometheus_url
    triggers: list[dict[str, Any]] = [{
        "type": "prometheus",
        "name": "capacity-miss-ratio",
        # Value, not AverageValue: a ratio does not grow with the number of pods.
        "metricType": "Value",
        "metadata": {
            "serverAddress": address,
            "query": capacity_miss_query(session),
            "threshold": str(scaling.target_capacity_miss_ratio),
            "ignoreNullValues": "true",
        },
    }]
    if scaling.target_queue_depth is not None:
        triggers.append({
            "type": "prometheus",
            "name": "queue-depth",
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": address,
                "query": queue_query(session),
                "threshold": str(scaling.target_queue_depth),
            },
        })
    obj = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": session_metadata(session, session.name, "autoscaler"),
        "spec": {
            "scaleTargetRef": _target(workload),
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": scaling.polling_interval_seconds,
            "cooldownPeriod": max(scaling.scale_down.stabilization_window_seconds, 1),
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(scaling)}},
            "triggers": triggers,
        },
    }
    return names.stamp(obj)


def adapter_rules() -> dict[str, Any]:
    """prometheus-adapter rules that serve the HPA's pod metrics (custom.metrics.k8s.io).

    Install them in the adapter's config (``rules:``); docs/operations.md shows how.
    """
    pods = {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}}
    return {"rules": [
        {
            "seriesQuery": f'{_QUERIED}{{namespace!="",pod!=""}}',
            "resources": pods,
            "name": {"matches": f"^{_QUERIED}$", "as": CAPACITY_MISS_METRIC},
            # Never NaN: a pod without queries has no value (not 0/0); with no value from any pod the HPA
            # holds, and a pod without one counts conservatively beside pods that have one.
            "metricsQuery": (
                f"sum by (<<.GroupBy>>) (rate({_CAPACITY_MISSES}{{<<.LabelMatchers>>}}[{RATE_WINDOW}])) / "
                f"(sum by (<<.GroupBy>>) (rate(<<.Series>>{{<<.LabelMatchers>>}}[{RATE_WINDOW}])) > 0)"
            ),
        },
        {
            "seriesQuery": f'{QUEUE_METRIC}{{namespace!="",pod!=""}}',
            "resources": pods,
            "name": {"matches": f"^{QUEUE_METRIC}$", "as": QUEUE_METRIC},
            "metricsQuery": "sum by (<<.GroupBy>>) (<<.Series>>{<<.LabelMatchers>>})",
        },
    ]}
