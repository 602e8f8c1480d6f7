"""Autoscaling on capacity misses: an HPA (through prometheus-adapter) or a KEDA ScaledObject.

Both target the InferenceSession's scale subresource, so the autoscaler writes
``InferenceSession.spec.replicas`` and the operator carries that count to the workload.

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

from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.settings import API_VERSION, OperatorSettings
from mambaserve.operator.spec import Autoscaling, InferenceSession

CAPACITY_MISS_METRIC = "mambaserve_cache_capacity_miss_ratio"
QUEUE_METRIC = "mambaserve_num_waiting_requests"
# Server counters (docs/server-interface.md).
_CAPACITY_MISSES = "mambaserve_prefix_cache_capacity_miss_tokens_total"
_QUERIED = "mambaserve_prefix_cache_queried_tokens_total"
RATE_WINDOW = "2m"


def _target(session: InferenceSession) -> dict[str, str]:
    return {"apiVersion": API_VERSION, "kind": "InferenceSession", "name": session.name}


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


def build_hpa(session: InferenceSession) -> dict[str, Any]:
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
            "scaleTargetRef": _target(session),
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": metrics,
            "behavior": _behavior(scaling),
        },
    }
    return names.stamp(obj)


def _series(session: InferenceSession) -> str:
    # ServiceMonitor.podTargetLabels copies the session label onto every scraped series.
    label = names.SESSION_LABEL.replace(".", "_").replace("/", "_").replace("-", "_")
    return f'namespace="{session.namespace}",{label}="{session.name}"'


def capacity_miss_query(session: InferenceSession) -> str:
    """The session's capacity-miss ratio; no traffic makes it 0/0 (no value), and KEDA holds."""
    sel = _series(session)
    return (f"sum(rate({_CAPACITY_MISSES}{{{sel}}}[{RATE_WINDOW}])) / "
            f"sum(rate({_QUERIED}{{{sel}}}[{RATE_WINDOW}]))")


def queue_query(session: InferenceSession) -> str:
    return f"sum({QUEUE_METRIC}{{{_series(session)}}})"


def build_scaled_object(session: InferenceSession, settings: OperatorSettings) -> dict[str, Any]:
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
            "scaleTargetRef": _target(session),
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
            # No traffic makes this 0/0: the adapter then returns no value and the HPA holds.
            "metricsQuery": (
                f"sum by (<<.GroupBy>>) (rate({_CAPACITY_MISSES}{{<<.LabelMatchers>>}}[{RATE_WINDOW}])) / "
                f"sum by (<<.GroupBy>>) (rate(<<.Series>>{{<<.LabelMatchers>>}}[{RATE_WINDOW}]))"
            ),
        },
        {
            "seriesQuery": f'{QUEUE_METRIC}{{namespace!="",pod!=""}}',
            "resources": pods,
            "name": {"matches": f"^{QUEUE_METRIC}$", "as": QUEUE_METRIC},
            "metricsQuery": "sum by (<<.GroupBy>>) (<<.Series>>{<<.LabelMatchers>>})",
        },
    ]}
