"""prometheus-operator ServiceMonitors: the server pods, and the router's metrics port."""

from __future__ import annotations

from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.settings import OperatorSettings
from mambaserve.operator.spec import InferenceSession


def _monitor(session: InferenceSession, settings: OperatorSettings, name: str, component: str,
             selector: dict[str, str], port: str) -> dict[str, Any]:
    meta = session_metadata(session, name, component)
    # The labels a Prometheus selects its monitors by (kube-prometheus-stack: `release`).
    meta["labels"].update(dict(settings.monitor_labels))
    obj = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector},
            "namespaceSelector": {"matchNames": [session.namespace]},
            "podTargetLabels": [names.SESSION_LABEL],
            "endpoints": [{"port": port, "path": "/metrics", "interval": session.monitoring.interval}],
        },
    }
    return names.stamp(obj)


def build_service_monitor(session: InferenceSession, settings: OperatorSettings) -> dict[str, Any]:
    # Only the headless service carries the metrics label, so pods are scraped once even when the
    # client service also selects them.
    return _monitor(session, settings, session.name, "server",
                    {names.SESSION_LABEL: session.name, names.METRICS_LABEL: "true"}, "http")


def build_router_monitor(session: InferenceSession, settings: OperatorSettings) -> dict[str, Any]:
    # The client service selects the router pods when there is a router, and names its metrics port.
    return _monitor(session, settings, names.router(session.name), "router",
                    {names.SESSION_LABEL: session.name, names.COMPONENT_LABEL: "router"}, "metrics")
