"""kube.apply/prune over real HTTP against the API emulator: server-side apply when the live object drifted."""

from __future__ import annotations

import copy
from typing import Any

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


def applies(cluster: Cluster) -> list[dict[str, Any]]:
    """The server-side applies the emulator received (their parameters)."""
    return [r.params for r in cluster.kmock if r.method == "PATCH"
            and "apply-patch" in r.headers.get("Content-Type", "")]


def manager_of(live: dict[str, Any], operation: str = "Apply") -> set[str]:
    return {e["manager"] for e in live["metadata"]["managedFields"] if e["operation"] == operation}


@pytest.mark.asyncio
async def test_apply_creates_then_leaves_unchanged_objects_alone(cluster: Cluster, kube: Kube) -> None:
    assert (await kube.apply(deployment())).action == "created"
    assert applies(cluster) == [{"fieldManager": "mambaserve-operator", "force": "true"}]
    versions = cluster.versions("Deployment", "web")
    assert (await kube.apply(deployment())).action == "unchanged"
    assert len(patches(cluster)) == 1  # in sync: no second write at all
    assert cluster.versions("Deployment", "web") == versions
    assert manager_of(cluster.get("Deployment", "web")) == {"mambaserve-operator"}


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
async def test_a_manual_edit_of_image_or_args_is_reverted_though_the_hash_matches(cluster: Cluster, kube: Kube) -> None:
    desired = deployment()
    desired["spec"]["template"]["spec"]["containers"] = [{"name": "server", "image": "mambaserve:1",
                                                          "args": ["--port", "30000"]}]
    desired = names.stamp(desired)
    await kube.apply(desired)
    # kubectl edit: the image and args change, the spec-hash annotation (what was compared before) does not.
    edited = [{"name": "server", "image": "evil:latest", "args": ["--port", "30000", "--debug"]}]
    await cluster.patch("Deployment", "web", {"spec": {"template": {"spec": {"containers": edited}}}})
    assert manager_of(cluster.get("Deployment", "web"), "Update") == {"kubectl-edit"}  # the edit owns them now
    assert (await kube.apply(desired)).action == "patched"
    live = cluster.get("Deployment", "web")
    assert live["spec"]["template"]["spec"]["containers"] == desired["spec"]["template"]["spec"]["containers"]
    assert (await kube.apply(desired)).action == "unchanged"
    # A field only others set (a webhook's sidecar in the keyed containers list) is not drift.
    sidecar = [*desired["spec"]["template"]["spec"]["containers"], {"name": "istio-proxy", "image": "proxy:1"}]
    await cluster.patch("Deployment", "web", {"spec": {"template": {"spec": {"containers": sidecar}}}})
    assert (await kube.apply(desired)).action == "unchanged"


@pytest.mark.asyncio
async def test_replica_drift_is_repaired_even_with_a_matching_hash(cluster: Cluster, kube: Kube) -> None:
    await kube.apply(deployment())
    await cluster.patch("Deployment", "web", {"spec": {"replicas": 7}})  # someone scaled the Deployment directly
    assert (await kube.apply(deployment())).action == "patched"
    assert cluster.get("Deployment", "web")["spec"]["replicas"] == 1


@pytest.mark.asyncio
async def test_objects_written_by_patches_are_taken_over_by_apply(cluster: Cluster, kube: Kube) -> None:
    """An object an earlier operator wrote with POST and JSON patches (no apply entry) is applied once, so
    that from then on the API server knows which fields are the operator's and removes the ones it drops."""
    await cluster.create(copy.deepcopy(deployment()))
    assert manager_of(cluster.get("Deployment", "web")) == set()
    assert (await kube.apply(deployment())).action == "patched"
    assert manager_of(cluster.get("Deployment", "web")) == {"mambaserve-operator"}


@pytest.mark.asyncio
async def test_replicas_handed_over_to_an_autoscaler_are_not_reset(cluster: Cluster, kube: Kube) -> None:
    await kube.apply(deployment(replicas=3))
    scaled = deployment()
    del scaled["spec"]["replicas"]  # an autoscaler owns them now
    scaled = names.stamp(scaled)
    assert (await kube.apply(scaled)).action == "patched"
    live = cluster.get("Deployment", "web")
    assert live["spec"]["replicas"] == 3  # applied without the field, it would have been removed
    assert {"mambaserve-operator-handover"} <= manager_of(live)
    await cluster.patch("Deployment", "web", {"spec": {"replicas": 5}})  # the autoscaler scales
    assert (await kube.apply(scaled)).action == "unchanged"
    assert cluster.get("Deployment", "web")["spec"]["replicas"] == 5


@pytest.mark.asyncio
async def test_immutable_change_recreates_a_statefulset_keeping_its_pods(cluster: Cluster, kube: Kube) -> None:
    obj = deployment(name="db")
    obj["kind"], obj["apiVersion"] = "StatefulSet", "apps/v1"
    names.stamp(obj, immutable={"volumeClaimTemplates": ["small"]})
    await kube.apply(obj)
    bigger = copy.deepcopy(obj)
    names.stamp(bigger, immutable={"volumeClaimTemplates": ["big"]})
    assert (await kube.apply(bigger)).action == "recreated"
    [delete] = [r for r in cluster.kmock if r.method == "DELETE"]
    assert delete.url.path == "/apis/apps/v1/namespaces/llm/statefulsets/db"
    # Orphaned, not deleted: the pods keep serving and the new StatefulSet adopts them.
    assert delete.data["propagationPolicy"] == "Orphan"
    assert cluster.get("StatefulSet", "db")["metadata"]["annotations"][names.IMMUTABLE_HASH] == \
        bigger["metadata"]["annotations"][names.IMMUTABLE_HASH]


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
        cluster.kmock.refuse("PATCH", "/apis/apps/v1/namespaces/llm/deployments/bad", 422, "Invalid",
                             "bad affinity")
        with pytest.raises(ApiError) as info:
            await client.apply(deployment("bad"))
        assert info.value.invalid and "bad affinity" in info.value.message
    finally:
        await client.close()
