"""A session moving between a Deployment and a StatefulSet (its CacheTier's storage mode changed) keeps
serving: the old workload goes only once the new one serves, within the rollout strategy's GPUs. The
emulator has no controllers: the test reports pods ready as the Deployment and StatefulSet controllers would."""

from __future__ import annotations

from typing import Any

import pytest

from tests.operator.conftest import Cluster, eventually, sample

pytestmark = pytest.mark.asyncio


async def ready(cluster: Cluster, kind: str, n: int) -> None:
    await cluster.patch(kind, "tiny", {"status": {"replicas": n, "readyReplicas": n, "updatedReplicas": n}},
                        sub="status", manager="kube-controller-manager")


def replicas(cluster: Cluster, kind: str) -> int | None:
    obj = cluster.get(kind, "tiny")
    return None if obj is None else obj["spec"].get("replicas")


async def start_on_a_shared_tier(cluster: Cluster, start_operator: Any, rollout: dict[str, Any] | None) -> None:
    await start_operator()
    shared = sample("cachetier-shared")
    del shared["spec"]["compatibility"]  # pinned to another model than this session's
    await cluster.create(shared)
    await cluster.create(sample("cachetier-per-pod"))
    body = sample("inferencesession-minimal")
    body["spec"].update({"replicas": 2, "cacheTierRef": {"name": "shared-tier"}})
    if rollout:
        body["spec"]["rollout"] = rollout
    await cluster.create(body)
    await eventually(lambda: replicas(cluster, "Deployment") == 2)
    await ready(cluster, "Deployment", 2)
    await eventually(lambda: cluster.condition("InferenceSession", "tiny", "Ready")["status"] == "True")
    # Per-pod storage: the session needs a StatefulSet now.
    await cluster.update_spec("InferenceSession", "tiny", {"cacheTierRef": {"name": "local-nvme"}})


async def test_replace_moves_one_pod_at_a_time_and_the_deployment_goes_last(cluster: Cluster,
                                                                            start_operator: Any) -> None:
    await start_on_a_shared_tier(cluster, start_operator, rollout=None)  # a GPU session, no spare GPU: Replace
    # One old pod gives its GPU to the first new one; the other keeps serving.
    await eventually(lambda: replicas(cluster, "StatefulSet") == 1 and replicas(cluster, "Deployment") == 1)
    progressing = await eventually(lambda: (c := cluster.condition("InferenceSession", "tiny", "Progressing"))
                                   and c["reason"] == "WorkloadMigration" and c)
    assert "moving from Deployment/tiny" in progressing["message"]
    await ready(cluster, "Deployment", 1)
    await ready(cluster, "StatefulSet", 1)
    await eventually(lambda: replicas(cluster, "StatefulSet") == 2 and replicas(cluster, "Deployment") == 0)
    assert cluster.get("Deployment", "tiny") is not None  # not gone before the new pods serve
    await ready(cluster, "Deployment", 0)
    await ready(cluster, "StatefulSet", 2)
    await eventually(lambda: cluster.get("Deployment", "tiny") is None)
    await eventually(lambda: cluster.condition("InferenceSession", "tiny", "Progressing")["reason"] != "WorkloadMigration")
    st = cluster.get("InferenceSession", "tiny")["status"]
    assert (st["workload"], st["readyReplicas"]) == ("StatefulSet/tiny", 2)
    assert cluster.condition("InferenceSession", "tiny", "Ready")["status"] == "True"


async def test_surge_starts_the_new_workload_whole_beside_the_old_one(cluster: Cluster, start_operator: Any) -> None:
    await start_on_a_shared_tier(cluster, start_operator, rollout={"spareGpus": 2})
    await eventually(lambda: replicas(cluster, "StatefulSet") == 2)
    assert replicas(cluster, "Deployment") == 2  # untouched: both serve side by side
    await ready(cluster, "StatefulSet", 1)
    await eventually(lambda: cluster.condition("InferenceSession", "tiny", "Progressing")["reason"]
                     == "WorkloadMigration")
    assert cluster.get("Deployment", "tiny") is not None
    await ready(cluster, "StatefulSet", 2)
    await eventually(lambda: cluster.get("Deployment", "tiny") is None)
    assert cluster.condition("InferenceSession", "tiny", "Ready")["status"] == "True"
