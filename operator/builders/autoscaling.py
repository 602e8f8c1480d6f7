"""Autoscaling on the prefix-cache hit rate: an HPA (through prometheus-adapter) or a KEDA ScaledObject.

Both target the InferenceSession's scale subresource, so the autoscaler writes
``InferenceSession.spec.replicas`` and the operator carries that count to the workload.

Autoscalers add replicas while a metric is *above* its target, and a falling hit rate is what
calls for more replicas (more aggregate cache), so the metric they see is the miss ratio,
``1 - hit rate``, against a target of ``1 - targetCacheHitRate``.
"""

from __future__ import annotations

from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.settings import API_VERSION, OperatorSettings
from mambaserve.operator.spec import Autoscaling, InferenceSession

MISS_RATIO_METRIC = "mambaserve_cache_miss_ratio"
QUEUE_METRIC = "mambaserve_num_waiting_requests"
# Server counters (docs/server-interface.md); hit tokens are labelled by tier, queried tokens are not.
_HITS = "mambaserve_prefix_cache_hit_tokens_total"
_QUERIED = "mambaserve_prefix_cache_queried_tokens_total"
RATE_WINDOW = "2m"


def _target(session: InferenceSession) -> dict[str, str]:
    return {"apiVersion": API_VERSION, "kind": "InferenceSession", "name": session.name}


def _miss_target(scaling: Autoscaling) -> float:
    return round(1.0 - scaling.target_cache_hit_rate, 4)


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
            "metric": {"name": MISS_RATIO_METRIC},
            "target": {"type": "AverageValue", "averageValue": _milli(_miss_target(scaling))},
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


def miss_ratio_query(session: InferenceSession) -> str:
    sel = _series(session)
    return (f"1 - (sum(rate({_HITS}{{{sel}}}[{RATE_WINDOW}])) / "
            f"sum(rate({_QUERIED}{{{sel}}}[{RATE_WINDOW}])))")


def build_scaled_object(session: InferenceSession, settings: OperatorSettings) -> dict[str, Any]:
    scaling = session.autoscaling
    address = scaling.prometheus_address or settings.prometheus_url
    triggers: list[dict[str, Any]] = [{
        "type": "prometheus",
        "name": "cache-miss-ratio",
        # Value, not AverageValue: a ratio does not grow with the number of pods.
        "metricType": "Value",
        "metadata": {
            "serverAddress": address,
            "query": miss_ratio_query(session),
            "threshold": str(_miss_target(scaling)),
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
                "query": f"sum({QUEUE_METRIC}{{{_series(session)}}})",
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
            "name": {"matches": f"^{_QUERIED}$", "as": MISS_RATIO_METRIC},
            # No traffic makes this 0/0: the adapter then returns no value and the HPA holds.
            "metricsQuery": (
                f"clamp_min(1 - (sum by (<<.GroupBy>>) (rate({_HITS}{{<<.LabelMatchers>>}}[{RATE_WINDOW}])) / "
                f"sum by (<<.GroupBy>>) (rate(<<.Series>>{{<<.LabelMatchers>>}}[{RATE_WINDOW}]))), 0)"
            ),
        },
        {
            "seriesQuery": f'{QUEUE_METRIC}{{namespace!="",pod!=""}}',
            "resources": pods,
            "name": {"matches": f"^{QUEUE_METRIC}$", "as": QUEUE_METRIC},
            "metricsQuery": "sum by (<<.GroupBy>>) (<<.Series>>{<<.LabelMatchers>>})",
        },
    ]}
