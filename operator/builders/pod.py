"""What every pod the operator renders is made of: Pod Security ``restricted`` contexts, writable
scratch directories under a read-only root filesystem, GPU tolerations, topology spread, the drain hook.

Pod Security ``restricted`` (Kubernetes Pod Security Standards) asks for: non-root, a
``RuntimeDefault`` or ``Localhost`` seccomp profile, no privilege escalation, every capability
dropped, and only configMap, csi, downwardAPI, emptyDir, ephemeral, persistentVolumeClaim,
projected and secret volumes. tests/operator checks every pod the operator renders against those rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# A fixed non-root identity. runAsNonRoot alone only works with a numeric USER in the image (the
# kubelet cannot tell whether a named user is root); fsGroup makes claims writable by that identity.
RUN_AS = 65532
TMP_DIR = "/tmp"


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        # Re-own a claim's files only when its root does not match yet: a full storage tier would
        # otherwise be walked file by file at every pod start.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def empty_dir(name: str, size: str, medium: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"sizeLimit": size}
    if medium:
        spec["medium"] = medium
    return {"name": name, "emptyDir": spec}


def mount(name: str, path: str, read_only: bool = False) -> dict[str, Any]:
    return {"name": name, "mountPath": path, **({"readOnly": True} if read_only else {})}


def gpu_tolerations(resource_name: str, extra: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """GPU nodes are commonly tainted ``<gpu resource>:NoSchedule`` (GKE, AKS, the NVIDIA GPU
    operator's guides); a pod that asks for the GPU tolerates it. The user's tolerations follow."""
    out = [{"key": resource_name, "operator": "Exists", "effect": "NoSchedule"}]
    for toleration in extra:
        if dict(toleration) not in out:
            out.append(dict(toleration))
    return out


def topology_spread(selector: Mapping[str, str], keys: Iterable[str]) -> list[dict[str, Any]]:
    """Spread replicas over the given topology keys, but never leave a pod Pending for it
    (ScheduleAnyway): GPUs are scarce, and a skewed pod still serves."""
    return [{
        "maxSkew": 1,
        "topologyKey": key,
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": dict(selector)},
    } for key in keys]


def drain_hook(seconds: int) -> dict[str, Any]:
    """A preStop hook that waits ``seconds`` before the container gets SIGTERM.

    The pod is NotReady from the moment it is deleted, so endpoints and the router stop sending it
    new work while in-flight turns finish. An exec of the image's own Python works on every
    Kubernetes version; the ``sleep`` action needs 1.30 (1.29 with an alpha gate) and is silently
    dropped where it is off. The hook's time counts against terminationGracePeriodSeconds.
    """
    return {"preStop": {"exec": {"command": ["python3", "-c", f"import time; time.sleep({seconds})"]}}}
