"""The SGLang Model Gateway in front of the server pods, with the RBAC its pod discovery needs."""

from __future__ import annotations

import dataclasses
from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders import pod
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.settings import ROUTER_METRICS_PORT, ROUTER_PORT, SERVER_PORT, OperatorSettings
from mambaserve.operator.spec import InferenceSession

ROUTER_HEALTH_CHECK_S = 5
ROUTER_HEALTH_FAILURES = 2


@dataclasses.dataclass(frozen=True)
class Routing:
    """The router's policy for a session, and why (``status.router``)."""
    policy: str
    assignment_mode: str | None
    reason: str

    def as_status(self) -> dict[str, str]:
        out = {"policy": self.policy, "reason": self.reason}
        if self.assignment_mode:
            out["assignmentMode"] = self.assignment_mode
        return out


def routing(session: InferenceSession) -> Routing:
    """``auto`` is sticky when the pods keep sessions, cache-aware otherwise; any other policy is taken as
    given. Sticky is ``manual`` with ``min_group``: a key's requests stay on the pod that holds its state
    (x-smg-routing-key), and a new key goes to the pod with the fewest keys in flight, so a pod added under
    load takes new sessions while the old ones stay where their state is."""
    asked = session.router.policy
    if asked == "auto":
        if session.sessions.streaming:
            return Routing("manual", "min_group", "auto: sessions.streaming is on, so each session's turns stay on "
                                                  "the pod holding its state (x-smg-routing-key)")
        return Routing("cache_aware", None, "auto: sessions.streaming is off, so requests go where their prefix "
                                            "is cached")
    return Routing(asked, "min_group" if asked == "manual" else None, "router.policy")


def router_args(session: InferenceSession) -> list[str]:
    selector = [f"{k}={v}" for k, v in sorted(names.server_selector(session.name).items())]
    chosen = routing(session)
    policy = ["--policy", chosen.policy]
    if chosen.assignment_mode:
        policy += ["--assignment-mode", chosen.assignment_mode]
    return [
        "--host", "0.0.0.0",
        "--port", str(ROUTER_PORT),
        *policy,
        "--service-discovery",
        "--selector", *selector,
        "--service-discovery-namespace", session.namespace,
        "--service-discovery-port", str(SERVER_PORT),
        "--prometheus-host", "0.0.0.0",
        "--prometheus-port", str(ROUTER_METRICS_PORT),
        # The router moves a key off a pod only once its health checks fail (a draining pod's /health is 503; a
        # killed one does not answer). Its defaults (every 60 s, 3 failures) kept a session's turns failing for
        # minutes after a kill -9: every 5 s, 2 failures, ~10 s.
        "--health-check-interval-secs", str(ROUTER_HEALTH_CHECK_S),
        "--health-failure-threshold", str(ROUTER_HEALTH_FAILURES),
    ]


def build_router_service_account(session: InferenceSession) -> dict[str, Any]:
    return names.stamp({
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": session_metadata(session, names.router(session.name), "router"),
        "automountServiceAccountToken": True,
    })


def build_router_role(session: InferenceSession) -> dict[str, Any]:
    # Discovery only reads pods of its own namespace (--service-discovery-namespace).
    return names.stamp({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": session_metadata(session, names.router(session.name), "router"),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    })


def build_router_role_binding(session: InferenceSession) -> dict[str, Any]:
    name = names.router(session.name)
    return names.stamp({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": session_metadata(session, name, "router"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": session.namespace}],
    })


def build_router_deployment(session: InferenceSession, settings: OperatorSettings) -> dict[str, Any]:
    name = names.router(session.name)
    labels = names.session_labels(session.name, "router")
    container = {
        "name": "router",
        "image": session.router.image or settings.router_image,
        "imagePullPolicy": session.image_pull_policy,
        "command": ["python3", "-m", "sglang_router.launch_router"],
        "args": router_args(session),
        "env": [{"name": "HOME", "value": pod.TMP_DIR}, {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
        "ports": [
            {"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {"httpGet": {"path": "/readiness", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/liveness", "port": "http"}, "periodSeconds": 15,
                          "failureThreshold": 4},
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
        "volumeMounts": [pod.mount("tmp", pod.TMP_DIR)],
        "securityContext": pod.container_security_context(),
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": name,
        "containers": [container],
        "volumes": [pod.empty_dir("tmp", "256Mi")],
        "enableServiceLinks": False,
        "securityContext": pod.pod_security_context(),
        # Two routers on one node would fail together.
        "topologySpreadConstraints": pod.topology_spread(names.router_selector(session.name),
                                                         ["kubernetes.io/hostname"]),
    }
    if session.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in session.image_pull_secrets]
    obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": session_metadata(session, name, "router"),
        "spec": {
            "replicas": session.router.replicas,
            "selector": {"matchLabels": names.router_selector(session.name)},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        },
    }
    return names.stamp(obj)


def build_router_pdb(session: InferenceSession) -> dict[str, Any]:
    # Every client request passes the router: a node drain takes at most one router pod at a time.
    return names.stamp({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": session_metadata(session, names.router(session.name), "router"),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": names.router_selector(session.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    })
