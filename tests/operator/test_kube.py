"""kube.apply/prune over real HTTP against the API emulator: create-or-patch guided by the spec hash."""

from __future__ import annotations

import copy
from typing import Any

import kmock as kmock_lib
import kopf
import pytest
import pytest_asyncio

from mambaserve.operator import names
from mambaserve.operator.kube import ApiError, Kube, ResourceNotInstalled
from tests.operator.conftest import Cluster, register_resources


def deployment(name: str = "web", **spec: Any) -> dict[str, Any]:
    obj = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": "llm", "labels": {names.SESSION_LABEL: "s"},
                     "ownerReferences": [names.owner_reference("InferenceSession", "s", "uid-s")]},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}},
                 "template": {"metadata": {"labels": {"a": "b"}},
                              "spec": {"nodeSelector": {"zone": "a", "gpu": "h100"}, "containers": []}},
                 **spec},
    }
    return names.stamp(obj)


@pytest_asyncio.fixture
async def kube(cluster: Cluster) -> Any:
    client = Kube(kopf.ConnectionInfo(server=cluster.url, insecure=True))
    yield client
    await client.close()


def patches(cluster: Cluster) -> list[str]:
    return [path for method, path in cluster.writes() if method == "PATCH"]


@pytest.mark.asyncio
async def test_apply_creates_then_leaves_unchanged_objects_alone(cluster: Cluster, kube: Kube) -> None:
    assert (await kube.apply(deployment())).action == "created"
    assert (await kube.apply(deployment())).action == "unchanged"
    assert patches(cluster) == []  # a matching hash means no write at all
    assert cluster.versions("Deployment", "web") == 1


@pytest.mark.asyncio
async def test_apply_patches_changes_and_drops_removed_keys(cluster: Cluster, kube: Kube) -> None:
    await kube.apply(deployment())
    # Another controller annotates and labels the object; those must survive our update.
    await cluster.patch("Deployment", "web", {"metadata": {"annotations": {"deployment.kubernetes.io/revision": "3"},
                                                           "labels": {"team": "x"}},
                                              "spec": {"progressDeadlineSeconds": 600}})
    changed = deployment()
    del changed["spec"]["template"]["spec"]["nodeSelector"]["zone"]
    changed["spec"]["replicas"] = 3
    changed = names.stamp(changed)
    assert (await kube.apply(changed)).action == "patched"
    live = cluster.get("Deployment", "web")
    assert live["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}  # removed key is gone
    assert live["spec"]["replicas"] == 3
    assert live["spec"]["progressDeadlineSeconds"] == 600  # a field we do not render is untouched
    assert live["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "3"
    assert live["metadata"]["labels"]["team"] == "x"
    assert live["metadata"]["annotations"][names.SPEC_HASH] == changed["metadata"]["annotations"][names.SPEC_HASH]


@pytest.mark.asyncio
async def test_replica_drift_is_repaired_even_with_a_matching_hash(cluster: Cluster, kube: Kube) -> None:
    await kube.apply(deployment())
    await cluster.patch("Deployment", "web", {"spec": {"replicas": 7}})  # someone scaled the Deployment directly
    assert (await kube.apply(deployment())).action == "patched"
    assert cluster.get("Deployment", "web")["spec"]["replicas"] == 1


@pytest.mark.asyncio
async def test_conflict_on_create_counts_as_success(cluster: Cluster, kube: Kube) -> None:
    await cluster.create(copy.deepcopy(deployment()))
    # The first read misses (as if the object appeared between our GET and POST): POST gets 409.
    cluster.kmock["get /apis/apps/v1/namespaces/llm/deployments/web"][:1] << 404
    result = await kube.apply(deployment())
    assert result.action == "unchanged"
    assert ("POST", "/apis/apps/v1/namespaces/llm/deployments") in cluster.writes()


@pytest.mark.asyncio
async def test_immutable_change_recreates_the_object(cluster: Cluster, kube: Kube) -> None:
    obj = deployment(name="db")
    obj["kind"], obj["apiVersion"] = "StatefulSet", "apps/v1"
    names.stamp(obj, immutable={"volumeClaimTemplates": ["small"]})
    await kube.apply(obj)
    bigger = copy.deepcopy(obj)
    names.stamp(bigger, immutable={"volumeClaimTemplates": ["big"]})
    assert (await kube.apply(bigger)).action == "recreated"
    assert ("DELETE", "/apis/apps/v1/namespaces/llm/statefulsets/db") in cluster.writes()


@pytest.mark.asyncio
async def test_prune_deletes_only_owned_stale_objects(cluster: Cluster, kube: Kube) -> None:
    await kube.apply(deployment("keep"))
    await kube.apply(deployment("stale"))
    foreign = deployment("foreign")
    foreign["metadata"]["ownerReferences"] = [names.owner_reference("InferenceSession", "s", "someone-else")]
    await kube.apply(foreign)
    deleted = await kube.prune(["Deployment", "ScaledObject"], "llm", {names.SESSION_LABEL: "s"}, "uid-s",
                               keep=[("Deployment", "keep")])
    assert deleted == [("Deployment", "stale")]
    assert cluster.names("Deployment") == {"keep", "foreign"}


@pytest.mark.asyncio
async def test_missing_kinds_and_invalid_objects_are_distinguished(kmock: Any) -> None:
    # Only core kinds are served here: KEDA is "not installed".
    register_resources(kmock, optional=())
    cluster = Cluster(kmock)
    client = Kube(kopf.ConnectionInfo(server=cluster.url, insecure=True))
    try:
        with pytest.raises(ResourceNotInstalled):
            await client.list("ScaledObject", "llm")
        assert await client.get("Deployment", "llm", "nope") is None
        cluster.kmock["post /apis/apps/v1/namespaces/llm/deployments"] << kmock_lib.Response(
            status=422, payload={"kind": "Status", "reason": "Invalid", "message": "bad affinity"})
        with pytest.raises(ApiError) as info:
            await client.create(deployment("bad"))
        assert info.value.invalid and "bad affinity" in info.value.message
    finally:
        await client.close()
