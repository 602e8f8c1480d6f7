"""Which server pods a scale-down removes: ``controller.kubernetes.io/pod-deletion-cost`` from each pod's open
sessions, so the ReplicaSet controller removes the ready pods holding the fewest sessions first.

Only a ReplicaSet reads the annotation (a Deployment's pods); a StatefulSet removes its highest ordinal
whatever it says, so its pods are left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from mambaserve.operator.kube import ApiError, Kube
from mambaserve.operator.status import PodMetrics

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"

log = logging.getLogger("mambaserve.operator.deletion_cost")


def deletion_cost(sessions: int) -> int:
    """The binary digits of the open-session count: 0, 1, 2-3 -> 2, 4-7 -> 3, ... Fewer sessions, lower cost.
    Buckets rather than the count: Kubernetes asks not to move the annotation with a metric (each change is a
    pod update that every watcher of pods receives); doubling buckets keep apart pods whose counts differ
    much and change only when a pod's count doubles or halves."""
    return max(sessions, 0).bit_length()


def _in_replica_set(pod: Mapping[str, Any]) -> bool:
    refs = (pod.get("metadata") or {}).get("ownerReferences") or ()
    return any(ref.get("kind") == "ReplicaSet" for ref in refs)


def changes(pods: Sequence[Mapping[str, Any]], scraped: Sequence[PodMetrics]) -> dict[str, str]:
    """Pod name -> the annotation value it should have, for the pods whose value differs. A pod that did not
    answer (or reports no session gauge) keeps what it has: unready pods go first anyway."""
    sessions = {m.pod: m.sessions_open for m in scraped if m.sessions_open is not None}
    out = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        name = meta.get("name")
        if name not in sessions or not _in_replica_set(pod):
            continue
        value = str(deletion_cost(sessions[name]))
        if (meta.get("annotations") or {}).get(ANNOTATION) != value:
            out[name] = value
    return out


async def keep(kube: Kube, namespace: str, pods: Sequence[Mapping[str, Any]], scraped: Sequence[PodMetrics]) -> None:
    """Patch the pods whose deletion cost moved. A refusal (a pod gone since it was listed, RBAC without
    pods/patch) is logged and skipped: the scale-down order is a preference, the reconcile goes on."""
    for name, value in changes(pods, scraped).items():
        try:
            await kube.merge_patch("Pod", namespace, name, {"metadata": {"annotations": {ANNOTATION: value}}})
        except ApiError as e:
            if e.status >= 500:
                raise  # transient: Kopf retries the handler
            log.warning("could not set %s=%s on pod %s/%s: %s", ANNOTATION, value, namespace, name, e)
