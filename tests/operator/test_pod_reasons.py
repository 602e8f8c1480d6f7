"""Status that explains: pod and workload objects (shaped as the kubelet, scheduler and Deployment
controller write them) into reasons, and those reasons into the InferenceSession's conditions and
events, through the real operator against the API emulator."""

from __future__ import annotations

from typing import Any

import pytest

from mambaserve.operator import names
from mambaserve.operator.pod_reasons import diagnose, pod_reasons, workload_reasons
from tests.operator.conftest import Cluster, eventually, sample

def pod(name: str, *, containers: list[dict[str, Any]] | None = None, init: list[dict[str, Any]] | None = None,
        conditions: list[dict[str, Any]] | None = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": names.session_labels("tiny", "server")}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": "Pending", "conditions": conditions or []}
    if containers is not None:
        status["containerStatuses"] = containers
    if init is not None:
        status["initContainerStatuses"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "server", "image": "registry.local/mambaserve:9"}]}, "status": status}


def waiting(reason: str, message: str = "", **extra: Any) -> dict[str, Any]:
    return {"name": "server", "image": "registry.local/mambaserve:9", "ready": False, "restartCount": 0,
            "state": {"waiting": {"reason": reason, **({"message": message} if message else {})}}, **extra}


PULL_MESSAGE = ('Back-off pulling image "registry.local/mambaserve:9": ErrImagePull: failed to pull and unpack image '
                '"registry.local/mambaserve:9": failed to resolve reference: not found')
UNSCHEDULABLE = ("0/3 nodes are available: 1 node(s) had untolerated taint {node-role.kubernetes.io/control-plane: }, "
                 "2 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 3 No preemption victims found.")
FORBIDDEN = ('pods "tiny-6b8f9c7d5-" is forbidden: violates PodSecurity "restricted:latest": '
             'allowPrivilegeEscalation != false (container "debug" must set securityContext.allowPrivilegeEscalation=false)')


def image_pull_pod(name: str = "tiny-6b8f9c7d5-abcde") -> dict[str, Any]:
    return pod(name, containers=[waiting("ImagePullBackOff", PULL_MESSAGE)])


def crash_pod(name: str = "tiny-6b8f9c7d5-crash") -> dict[str, Any]:
    last = {"terminated": {"reason": "OOMKilled", "exitCode": 137, "startedAt": "2025-01-01T00:00:00Z",
                           "finishedAt": "2025-01-01T00:01:00Z"}}
    return pod(name, containers=[waiting("CrashLoopBackOff", "back-off 5m0s restarting failed container=server",
                                         lastState=last, restartCount=7)])


def pending_pod(name: str = "tiny-6b8f9c7d5-pendg") -> dict[str, Any]:
    return pod(name, conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                  "message": UNSCHEDULABLE}])


def refused_deployment() -> dict[str, Any]:
    return {"status": {"replicas": 0, "conditions": [
        {"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable"},
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": FORBIDDEN}]}}


def test_image_pull_failure_names_the_image_and_the_registrys_message() -> None:
    [r] = pod_reasons(image_pull_pod())
    assert r.reason == "ImagePullFailed"
    assert "registry.local/mambaserve:9" in r.message and "ImagePullBackOff" in r.message and "not found" in r.message
    assert r.describe().startswith("pod tiny-6b8f9c7d5-abcde: container server cannot pull")
    # The model download (an init container) can fail to pull too.
    init = pod("p", init=[{**waiting("ErrImagePull", "unauthorized"), "name": "model-download"}])
    assert "init container model-download" in pod_reasons(init)[0].message


def test_crash_loop_reports_the_last_exit() -> None:
    [r] = pod_reasons(crash_pod())
    assert r.reason == "CrashLoopBackOff"
    assert "OOMKilled" in r.message and "exit code 137" in r.message
    assert "restart" not in r.message  # no restart count: it would make every restart a new status write


def test_unschedulable_carries_the_schedulers_message() -> None:
    [r] = pod_reasons(pending_pod())
    assert r.reason == "Unschedulable" and "2 Insufficient nvidia.com/gpu" in r.message


def test_admission_refusal_from_the_deployments_replica_failure() -> None:
    [r] = workload_reasons(refused_deployment())
    assert r.reason == "AdmissionRefused" and "violates PodSecurity" in r.message and "FailedCreate" in r.message


def test_healthy_starting_and_stopping_pods_have_no_reason() -> None:
    creating = pod("a", containers=[waiting("ContainerCreating")])
    running = pod("b", containers=[{"name": "server", "state": {"running": {}}, "ready": True}],
                  conditions=[{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}])
    assert diagnose({"status": {"conditions": [{"type": "Available", "status": "True"}]}},
                    [creating, running, {**image_pull_pod("c"), "metadata": {
                        "name": "c", "deletionTimestamp": "2025-01-01T00:00:00Z"}}]) == []


def test_diagnose_merges_pods_and_orders_by_what_to_fix_first() -> None:
    reasons = diagnose(refused_deployment(), [pending_pod("p1"), crash_pod("c1"), image_pull_pod("i1"),
                                              image_pull_pod("i2"), pending_pod("p2")])
    assert [r.reason for r in reasons] == ["AdmissionRefused", "ImagePullFailed", "CrashLoopBackOff", "Unschedulable"]
    pulls = reasons[1]
    assert pulls.pods == ("i1", "i2") and pulls.describe().startswith("pod i1 (and 1 more):")


# --- through the operator ----------------------------------------------------------------------


def _events(cluster: Cluster) -> list[dict[str, Any]]:
    return [r.data for r in cluster.kmock if r.method == "POST" and r.url.path.endswith("/events")]


@pytest.mark.asyncio
@pytest.mark.parametrize("make, reason, words", [
    (image_pull_pod, "ImagePullFailed", "not found"),
    (crash_pod, "CrashLoopBackOff", "OOMKilled"),
    (pending_pod, "Unschedulable", "Insufficient nvidia.com/gpu"),
])
async def test_pod_reasons_reach_the_conditions_and_events(cluster: Cluster, start_operator: Any, make: Any,
                                                           reason: str, words: str) -> None:
    await start_operator()
    await cluster.create(sample("inferencesession-minimal"))
    await eventually(lambda: cluster.get("Deployment", "tiny"))
    await cluster.create(make())
    ready = await eventually(lambda: (c := cluster.condition("InferenceSession", "tiny", "Ready"))
                             and c["reason"] == reason and c)
    assert ready["status"] == "False" and words in ready["message"] and ready["message"].startswith("0/1 server pods")
    event = await eventually(lambda: [e for e in _events(cluster) if e["reason"] == reason])
    assert event[0]["type"] == "Warning" and words in event[0]["message"]


@pytest.mark.asyncio
async def test_admission_refusal_reaches_the_conditions(cluster: Cluster, start_operator: Any) -> None:
    await start_operator()
    await cluster.create(sample("inferencesession-minimal"))
    await eventually(lambda: cluster.get("Deployment", "tiny"))
    # What the Deployment controller writes when admission refuses the ReplicaSet's pods.
    await cluster.patch("Deployment", "tiny", refused_deployment(), sub="status")
    ready = await eventually(lambda: (c := cluster.condition("InferenceSession", "tiny", "Ready"))
                             and c["reason"] == "AdmissionRefused" and c)
    assert "violates PodSecurity" in ready["message"]
    progressing = cluster.condition("InferenceSession", "tiny", "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "AdmissionRefused")
    await eventually(lambda: any(e["reason"] == "AdmissionRefused" for e in _events(cluster)))
    # Fixed: the condition goes back to plain readiness once nothing explains a failure.
    await cluster.patch("Deployment", "tiny", {"status": {"conditions": [
        {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"}],
        "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}, sub="status")
    await eventually(lambda: cluster.condition("InferenceSession", "tiny", "Ready")["reason"] == "ReplicasReady")
