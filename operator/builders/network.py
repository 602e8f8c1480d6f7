"""The optional NetworkPolicy of a session's server pods (operator flag ``--network-policies``)."""

from __future__ import annotations

from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.settings import SERVER_PORT, OperatorSettings
from mambaserve.operator.spec import InferenceSession

NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace (1.21+)


def build_network_policy(session: InferenceSession, settings: OperatorSettings) -> dict[str, Any]:
    """Server pods accept connections on their port from pods of their own namespace (clients, the router),
    from the operator's namespace (it reads /metrics) and from the metrics namespaces (Prometheus); nothing
    else reaches them. Egress is left open: model downloads and storage tiers need it."""
    namespaces = sorted({*filter(None, [settings.operator_namespace]), *settings.metrics_namespaces} - {session.namespace})
    peers: list[dict[str, Any]] = [{"podSelector": {}}]
    peers += [{"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: ns}}} for ns in namespaces]
    obj = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": session_metadata(session, session.name, "server"),
        "spec": {
            "podSelector": {"matchLabels": names.server_selector(session.name)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": SERVER_PORT}]}],
        },
    }
    return names.stamp(obj)
