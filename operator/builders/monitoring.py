"""prometheus-operator ServiceMonitor for the server pods."""

from __future__ import annotations

from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.spec import InferenceSession


def build_service_monitor(session: InferenceSession) -> dict[str, Any]:
    obj = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": session_metadata(session, session.name, "server"),
        "spec": {
            # Only the headless service carries the metrics label, so pods are scraped once even
            # when the client service also selects them.
            "selector": {"matchLabels": {names.SESSION_LABEL: session.name, names.METRICS_LABEL: "true"}},
            "namespaceSelector": {"matchNames": [session.namespace]},
            "podTargetLabels": [names.SESSION_LABEL],
            "endpoints": [{"port": "http", "path": "/metrics", "interval": session.monitoring.interval}],
        },
    }
    return names.stamp(obj)
