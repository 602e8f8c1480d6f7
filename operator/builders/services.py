"""Services: the client entry point and the headless service of the server pods."""

from __future__ import annotations

from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.settings import ROUTER_METRICS_PORT, ROUTER_PORT, SERVER_PORT
from mambaserve.operator.spec import InferenceSession


def service_url(session: InferenceSession) -> str:
    port = ROUTER_PORT if session.router.enabled else SERVER_PORT
    return f"http://{names.client_service(session.name)}.{session.namespace}.svc:{port}"


def build_client_service(session: InferenceSession) -> dict[str, Any]:
    """What clients call: the router when there is one, otherwise the server pods directly."""
    if session.router.enabled:
        selector, port = names.router_selector(session.name), ROUTER_PORT
    else:
        selector, port = names.server_selector(session.name), SERVER_PORT
    spec: dict[str, Any] = {
        "type": "ClusterIP",
        "selector": selector,
        "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
    }
    if session.router.enabled:
        # The router's own Prometheus endpoint, for its ServiceMonitor.
        spec["ports"].append({"name": "metrics", "port": ROUTER_METRICS_PORT, "targetPort": "metrics",
                              "protocol": "TCP"})
    if not session.router.enabled and session.sessions.streaming:
        # Without a router, client-IP affinity is the only thing that keeps a session's turns on
        # the pod holding its state; hold it as long as the server keeps an idle session.
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": min(session.sessions.timeout_seconds, 86400)}}
    obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": session_metadata(session, names.client_service(session.name),
                                     "router" if session.router.enabled else "server"),
        "spec": spec,
    }
    return names.stamp(obj)


def build_headless_service(session: InferenceSession) -> dict[str, Any]:
    """Per-pod DNS for the StatefulSet, and the endpoints that Prometheus scrapes."""
    meta = session_metadata(session, names.headless_service(session.name), "server")
    meta["labels"][names.METRICS_LABEL] = "true"
    obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "selector": names.server_selector(session.name),
            "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return names.stamp(obj)
