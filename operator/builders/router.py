"""The SGLang Model Gateway in front of the server pods, with the RBAC its pod discovery needs."""

from __future__ import annotations

from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders import pod
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.settings import ROUTER_METRICS_PORT, ROUTER_PORT, SERVER_PORT, OperatorSettings
from mambaserve.operator.spec import InferenceSession


def router_args(session: InferenceSession) -> list[str]:
    selector = [f"{k}={v}" for k, v in sorted(names.server_selector(session.name).items())]
    # manual: sticky per x-smg-routing-key (a session's turns reach the pod holding its state); a new key
    # goes to the pod with the fewest keys, not a random one
    policy = ["--policy", "manual", "--assignment-mode", "min_group"] if session.router.policy == "manual" \
        else ["--policy", session.router.policy]
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
