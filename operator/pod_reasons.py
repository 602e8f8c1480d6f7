"""Why server pods are not serving: pure functions from pod and workload objects to reasons.

"0/1 server pods ready" tells an operator nothing; the pods and the workload already say why
(the kubelet's waiting reasons, the scheduler's PodScheduled message, the Deployment's
ReplicaFailure condition when admission refuses its pods). These functions pick those out, most
actionable first, so the InferenceSession's conditions and events can repeat them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Waiting reasons of a container that will not fix themselves, by the reason reported for them.
_IMAGE_PULL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "RegistryUnavailable"}
_CONFIG = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}

# Most actionable first: a refused pod never exists, an image that never pulls never starts, ...
PRIORITY = ("AdmissionRefused", "ImagePullFailed", "ContainerConfigError", "CrashLoopBackOff", "Unschedulable",
            "ProgressDeadlineExceeded", "WaitingForModel")


@dataclasses.dataclass(frozen=True)
class PodReason:
    reason: str  # one of PRIORITY
    message: str
    pods: tuple[str, ...] = ()

    def describe(self) -> str:
        if not self.pods:
            return self.message
        who = self.pods[0] if len(self.pods) == 1 else f"{self.pods[0]} (and {len(self.pods) - 1} more)"
        return f"pod {who}: {self.message}"


def _containers(pod: Mapping[str, Any]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    status = pod.get("status") or {}
    for key, kind in (("initContainerStatuses", "init container"), ("containerStatuses", "container")):
        for c in status.get(key) or ():
            yield f"{kind} {c.get('name', '?')}", c


def _last_exit(container: Mapping[str, Any]) -> str:
    term = (container.get("lastState") or {}).get("terminated") or {}
    if not term:
        return "no termination recorded"
    parts = [f"last exit: {term.get('reason') or 'Unknown'}", f"exit code {term.get('exitCode', '?')}"]
    if term.get("signal"):
        parts.append(f"signal {term['signal']}")
    text = ", ".join(parts)
    if term.get("message"):
        text += f": {str(term['message']).strip()[:300]}"
    return text


def pod_reasons(pod: Mapping[str, Any]) -> list[PodReason]:
    """What keeps one pod from serving, if it is anything a person has to fix."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return []  # a stopping pod's state is the rollout's business, not a failure
    name = meta.get("name", "?")
    found: list[PodReason] = []
    for where, c in _containers(pod):
        waiting = (c.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason") or ""
        detail = str(waiting.get("message") or "").strip()
        if reason in _IMAGE_PULL:
            image = c.get("image") or ""
            found.append(PodReason("ImagePullFailed", f"{where} cannot pull image {image}: {reason}"
                                                      + (f": {detail}" if detail else ""), (name,)))
        elif reason in _CONFIG:
            found.append(PodReason("ContainerConfigError", f"{where}: {reason}" + (f": {detail}" if detail else ""),
                                   (name,)))
        elif reason == "CrashLoopBackOff":
            # No restart count in the text: it would turn every restart into a new status write and event.
            found.append(PodReason("CrashLoopBackOff", f"{where} keeps crashing ({_last_exit(c)})", (name,)))
    for cond in status.get("conditions") or ():
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                and cond.get("reason") in ("Unschedulable", "SchedulingGated", None, ""):
            message = str(cond.get("message") or cond.get("reason") or "not scheduled").strip()
            found.append(PodReason("Unschedulable", f"cannot be scheduled: {message}", (name,)))
    return found


def workload_reasons(workload: Mapping[str, Any] | None) -> list[PodReason]:
    """Reasons a Deployment (or its ReplicaSet, whose condition it copies) reports itself."""
    found: list[PodReason] = []
    for cond in ((workload or {}).get("status") or {}).get("conditions") or ():
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            # e.g. FailedCreate: pods "x" is forbidden: violates PodSecurity "restricted:latest": ...
            found.append(PodReason("AdmissionRefused", f"{cond.get('reason') or 'FailedCreate'}: "
                                                       f"{str(cond.get('message') or '').strip()}"))
        elif cond.get("type") == "Progressing" and cond.get("status") == "False" \
                and cond.get("reason") == "ProgressDeadlineExceeded":
            found.append(PodReason("ProgressDeadlineExceeded", str(cond.get("message") or "").strip()))
    return found


def diagnose(workload: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]]) -> list[PodReason]:
    """Every distinct reason, pods of the same reason merged, most actionable first.

    A Deployment copies its newest ReplicaSet's ReplicaFailure condition, so reading the Deployment
    is enough for admission refusals. A StatefulSet has no such condition (its refusals are events
    only), so for per-pod storage tiers an admission refusal shows as pods that never appear.
    """
    raw = workload_reasons(workload)
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        raw += pod_reasons(pod)
    merged: dict[str, PodReason] = {}
    for r in raw:
        if r.reason in merged:
            before = merged[r.reason]
            pods_ = before.pods + tuple(p for p in r.pods if p not in before.pods)
            merged[r.reason] = dataclasses.replace(before, pods=pods_)
        else:
            merged[r.reason] = r
    return sorted(merged.values(), key=lambda r: PRIORITY.index(r.reason))
