"""The finalizer is optional, and what the uninstall hook runs removes it: objects stay deletable
once the operator is gone. Real operator (Kopf) and the real hook code against the API emulator."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from mambaserve.operator.kube import Kube
from mambaserve.operator.reconciler import sync_tier_bindings
from mambaserve.operator.uninstall import FINALIZER, release_finalizers, stop_operator
from tests.operator.conftest import Cluster, eventually, sample

pytestmark = pytest.mark.asyncio


def finalizers(cluster: Cluster, kind: str, name: str, namespace: str = "llm") -> list[str]:
    return list(((cluster.get(kind, name, namespace) or {}).get("metadata") or {}).get("finalizers") or [])


async def create_session_on_tier(cluster: Cluster) -> None:
    """CacheTier ``shared-tier`` and InferenceSession ``tiny`` bound to it, in namespace llm."""
    tier = sample("cachetier-shared")
    tier["spec"].pop("compatibility")
    await cluster.create(tier)
    body = sample("inferencesession-minimal")
    body["spec"]["cacheTierRef"] = {"name": "shared-tier"}
    await cluster.create(body)


async def test_without_finalizers_deletion_never_waits_for_the_operator(cluster: Cluster,
                                                                        start_operator: Any) -> None:
    await start_operator(finalizers=False)
    await create_session_on_tier(cluster)
    await eventually(lambda: cluster.get("Deployment", "tiny"))
    await eventually(lambda: (cluster.get("CacheTier", "shared-tier") or {}).get("status", {}).get("boundSessions"))
    await asyncio.sleep(1.0)  # several status ticks: the timers add no finalizer either
    assert finalizers(cluster, "InferenceSession", "tiny") == [] and finalizers(cluster, "CacheTier", "shared-tier") == []
    # A tier in use goes at once (nothing holds it); the session then says so.
    await cluster.delete("CacheTier", "shared-tier")
    assert cluster.get("CacheTier", "shared-tier") is None
    cond = await eventually(lambda: (c := cluster.condition("InferenceSession", "tiny", "CacheTierBound"))
                            and c["reason"] == "NotFound" and c)
    assert cond["status"] == "False"
    await cluster.delete("InferenceSession", "tiny")
    assert cluster.get("InferenceSession", "tiny") is None


async def test_a_tier_deleted_between_read_and_status_write_is_not_an_error(cluster: Cluster) -> None:
    """The race CI once hit: a session's tick read the tier, then the tier went before the status
    write (404). An error there stalls the session's timer for its retry backoff."""
    body = sample("inferencesession-minimal")
    body["spec"]["cacheTierRef"] = {"name": "shared-tier"}
    await cluster.create(body)

    class StaleRead(Kube):
        async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
            return {"metadata": {"name": name}} if kind == "CacheTier" else await super().get(kind, namespace, name)

    kube = StaleRead(kopf.ConnectionInfo(server=cluster.url, insecure=True))
    try:
        await sync_tier_bindings(kube, "llm", "shared-tier")
    finally:
        await kube.close()
    assert cluster.get("CacheTier", "shared-tier") is None


async def _controller(kube: Kube, name: str, namespace: str) -> None:
    """The Deployment controller's part: once scaled to zero, the pods go and status says so."""
    while True:
        dep = await kube.get("Deployment", namespace, name) or {}
        if (dep.get("spec") or {}).get("replicas") == 0:
            await asyncio.sleep(0.3)
            await kube.patch_status("Deployment", namespace, name, {"replicas": 0, "readyReplicas": 0})
            return
        await asyncio.sleep(0.05)


async def test_release_finalizers_stops_the_operator_then_frees_every_object(cluster: Cluster,
                                                                             start_operator: Any) -> None:
    op = await start_operator()  # finalizers on (the default)
    await create_session_on_tier(cluster)
    elsewhere = sample("inferencesession-minimal")
    elsewhere["metadata"]["namespace"] = "other"
    await cluster.create(elsewhere)
    await cluster.create({"apiVersion": "apps/v1", "kind": "Deployment",
                          "metadata": {"name": "mambaserve-operator", "namespace": "mambaserve-system"},
                          "spec": {"replicas": 1}, "status": {"replicas": 1, "readyReplicas": 1}})
    objects = (("InferenceSession", "tiny", "llm"), ("CacheTier", "shared-tier", "llm"),
               ("InferenceSession", "tiny", "other"))
    await eventually(lambda: all(FINALIZER in finalizers(cluster, kind, name, ns) for kind, name, ns in objects))
    # The real operator is cancelled here, as the hook's scale-down stops its pod. (From here on the
    # test talks to the emulator through the operator's own client: kmock's test client does not
    # survive the cancelled watch streams.)
    await op.stop()

    kube = Kube(kopf.ConnectionInfo(server=cluster.url, insecure=True))
    try:
        controller = asyncio.create_task(_controller(kube, "mambaserve-operator", "mambaserve-system"))
        assert await stop_operator(kube, "mambaserve-system", "mambaserve-operator", timeout=10, interval=0.1)
        await controller
        released = await release_finalizers(kube)
        assert sorted(released) == ["CacheTier llm/shared-tier", "InferenceSession llm/tiny",
                                    "InferenceSession other/tiny"]
        assert await release_finalizers(kube) == []  # idempotent: a retried hook Job does nothing more
        assert await stop_operator(kube, "mambaserve-system", "gone") is False
        # With no operator running, deletion is immediate; the children are the garbage collector's.
        for kind, name, ns in objects:
            await kube.delete(kind, ns, name)
            assert await kube.get(kind, ns, name) is None
    finally:
        await kube.close()


async def test_release_finalizers_keeps_other_finalizers_and_can_be_limited_to_namespaces(cluster: Cluster) -> None:
    for ns in ("llm", "other"):
        body = sample("inferencesession-minimal")
        body["metadata"].update({"namespace": ns, "finalizers": ["example.com/keep", FINALIZER]})
        await cluster.create(body)
    kube = Kube(kopf.ConnectionInfo(server=cluster.url, insecure=True))
    try:
        assert await release_finalizers(kube, ["llm"]) == ["InferenceSession llm/tiny"]
    finally:
        await kube.close()
    assert finalizers(cluster, "InferenceSession", "tiny") == ["example.com/keep"]
    assert FINALIZER in (cluster.get("InferenceSession", "tiny", "other") or {})["metadata"]["finalizers"]


async def test_turning_finalizers_off_releases_objects_that_have_one(cluster: Cluster, start_operator: Any) -> None:
    body = sample("inferencesession-minimal")
    body["metadata"]["finalizers"] = [FINALIZER]  # left by an operator that ran with finalizers on
    await cluster.create(body)
    await start_operator(finalizers=False)
    await eventually(lambda: cluster.get("Deployment", "tiny"))
    await eventually(lambda: finalizers(cluster, "InferenceSession", "tiny") == [])
