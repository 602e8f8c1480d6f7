"""The real operator (Kopf + handlers + kube client) against kmock's Kubernetes API emulator."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import re
from typing import Any

import aiohttp.web
import kmock as kmock_lib
import pytest

from mambaserve.operator import names
from tests.operator.conftest import Cluster, eventually, load_crd, register_resources, sample
from mambaserve.operator.crd_schema import admit

pytestmark = pytest.mark.asyncio

SESSION_KINDS = ["ConfigMap", "Service", "Deployment", "StatefulSet", "PodDisruptionBudget",
                 "HorizontalPodAutoscaler", "ScaledObject", "ServiceMonitor", "ServiceAccount", "Role", "RoleBinding"]


def chat_session() -> dict[str, Any]:
    body = sample("inferencesession-autoscaled")
    body["spec"]["model"].pop("tokenSecretRef")
    return body


def owned(cluster: Cluster, owner_uid: str) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for kind in SESSION_KINDS + ["PersistentVolumeClaim"]:
        for name in cluster.names(kind):
            obj = cluster.get(kind, name)
            if any(r["uid"] == owner_uid for r in obj["metadata"].get("ownerReferences", [])):
                out[kind, name] = obj
    return out


def status(cluster: Cluster, kind: str, name: str) -> dict[str, Any]:
    return (cluster.get(kind, name) or {}).get("status") or {}


def events(cluster: Cluster) -> list[dict[str, Any]]:
    """Events the operator posted (the emulator keeps only the first, so read the requests)."""
    return [r.data for r in cluster.kmock if r.method == "POST" and r.url.path.endswith("/events")]


async def test_session_lifecycle_create_update_scale_status_delete(cluster: Cluster, start_operator: Any) -> None:
    await start_operator(service_monitors=True)
    tier = await cluster.create(sample("cachetier-shared"))
    session = await cluster.create(chat_session())
    uid = session["metadata"]["uid"]

    expected = {("ConfigMap", "chat-config"), ("Service", "chat"), ("Service", "chat-headless"),
                ("Deployment", "chat"), ("PodDisruptionBudget", "chat"), ("HorizontalPodAutoscaler", "chat"),
                ("ServiceAccount", "chat-router"), ("Role", "chat-router"), ("RoleBinding", "chat-router"),
                ("Deployment", "chat-router"), ("PodDisruptionBudget", "chat-router"), ("ServiceMonitor", "chat"),
                ("ServiceMonitor", "chat-router")}
    children = await eventually(lambda: (c := owned(cluster, uid)) and set(c) == expected and c)
    for obj in children.values():
        ref = obj["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["controller"]) == ("InferenceSession", "chat", True)
    claim = await eventually(lambda: cluster.get("PersistentVolumeClaim", "shared-tier-storage"))
    assert claim["metadata"]["ownerReferences"][0]["uid"] == tier["metadata"]["uid"]

    st = await eventually(lambda: (s := status(cluster, "InferenceSession", "chat")).get("conditions") and s)
    assert st["observedGeneration"] == 1
    assert st["selector"] == "app.kubernetes.io/component=server,mambaserve.io/session=chat"
    assert st["url"] == "http://chat.llm.svc:30000"
    assert st["router"] == {"policy": "cache_aware", "reason": "router.policy"}  # the sample sets it
    assert cluster.condition("InferenceSession", "chat", "CacheTierBound")["status"] == "True"
    assert cluster.condition("InferenceSession", "chat", "Autoscaling")["status"] == "True"
    await eventually(lambda: status(cluster, "CacheTier", "shared-tier").get("boundSessions") == ["chat"])

    # A spec change: the workload is patched in place (same object, new args), generation observed.
    await cluster.update_spec("InferenceSession", "chat", {"server": {"chunkedPrefillSize": 8192}})
    args = lambda: cluster.get("Deployment", "chat")["spec"]["template"]["spec"]["containers"][0]["args"]  # noqa: E731
    await eventually(lambda: args()[args().index("--chunked-prefill-size") + 1] == "8192")
    await eventually(lambda: status(cluster, "InferenceSession", "chat").get("observedGeneration") == 2)

    # The HPA scales the Deployment itself (it goes on while the operator is down); the operator leaves
    # the count to it: the replicas it had applied were handed over, not removed.
    hpa = cluster.get("HorizontalPodAutoscaler", "chat")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "chat"}
    assert "replicas" not in cluster.get("Deployment", "chat")["spec"]  # left to the API server's default, 1
    await cluster.patch("Deployment", "chat", {"spec": {"replicas": 5}}, manager="horizontal-pod-autoscaler")
    await asyncio.sleep(1.0)  # three status ticks
    assert cluster.get("Deployment", "chat")["spec"]["replicas"] == 5

    # The Deployment controller reports ready pods: the session becomes Ready, every tier setting honoured.
    await cluster.patch("Deployment", "chat", {"status": {"replicas": 5, "readyReplicas": 5, "updatedReplicas": 5}},
                        sub="status")
    await cluster.patch("Deployment", "chat-router", {"status": {"replicas": 2, "readyReplicas": 2}}, sub="status")
    await eventually(lambda: cluster.condition("InferenceSession", "chat", "Ready")["status"] == "True")
    await eventually(lambda: status(cluster, "InferenceSession", "chat").get("phase") == "Ready")
    assert cluster.condition("InferenceSession", "chat", "Degraded")["status"] == "False"
    st = status(cluster, "InferenceSession", "chat")
    assert (st["replicas"], st["readyReplicas"], st["metricsSource"]) == (5, 5, "workload")
    assert cluster.condition("InferenceSession", "chat", "RouterReady")["status"] == "True"
    # What the operator wrote is valid for the CRDs' status schemas (nothing would be pruned or refused).
    assert admit(load_crd("inferencesessions"), cluster.get("InferenceSession", "chat"))[1] == []
    assert admit(load_crd("cachetiers"), cluster.get("CacheTier", "shared-tier"))[1] == []
    await eventually(lambda: any(e["reason"] == "ReadyTrue" for e in events(cluster)))

    # Delete: every child goes, the tier lets go of the session.
    await cluster.delete("InferenceSession", "chat")
    await eventually(lambda: cluster.get("InferenceSession", "chat") is None)
    await eventually(lambda: owned(cluster, uid) == {})
    await eventually(lambda: status(cluster, "CacheTier", "shared-tier").get("boundSessions") == [])


@contextlib.asynccontextmanager
async def metrics_stub(handler: Any):
    """A server pod's /metrics stand-in on a free loopback port (yields the port)."""
    app = aiohttp.web.Application()
    app.router.add_get("/metrics", handler)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def create_ready_pods(cluster: Cluster, port: int, n: int = 2) -> None:
    """``n`` ready server pods of session ``tiny`` whose http port is ``port`` on loopback."""
    for i in range(n):
        await cluster.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"tiny-{i}", "labels": names.session_labels("tiny", "server")},
            "spec": {"containers": [{"name": "server", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        })


async def test_status_from_pod_metrics(cluster: Cluster, start_operator: Any) -> None:
    # A stand-in for a server pod's /metrics (documented metric names; the real server is not built here).
    async def metrics(request: aiohttp.web.Request) -> aiohttp.web.Response:
        pod = request.query.get("pod", "")
        return aiohttp.web.Response(text=(
            "# TYPE mambaserve_cache_hit_rate gauge\nmambaserve_cache_hit_rate 0.8\n"
            "# TYPE mambaserve_sessions_open gauge\nmambaserve_sessions_open 3\n" + pod))
    async with metrics_stub(metrics) as port:
        await start_operator()
        await cluster.create(sample("inferencesession-minimal"))
        await eventually(lambda: cluster.get("Deployment", "tiny"))
        await create_ready_pods(cluster, port)
        # A pod that is not ready is not scraped (and does not count).
        await cluster.create({"apiVersion": "v1", "kind": "Pod",
                              "metadata": {"name": "tiny-x", "labels": names.session_labels("tiny", "server")},
                              "status": {"podIP": "127.0.0.9", "conditions": [{"type": "Ready", "status": "False"}]}})
        # Both ready pods are scraped (3 sessions each); the unready one is not.
        st = await eventually(lambda: (s := status(cluster, "InferenceSession", "tiny")).get("openSessions")
                              == 6 and s)
        assert st["metricsSource"] == "metrics"
        assert st["cacheHitRate"] == 0.8
        assert st["tensorParallelSize"] == 1  # (the sample's one GPU)
        await asyncio.sleep(0.7)  # two more ticks: the unready pod still does not count
        assert status(cluster, "InferenceSession", "tiny")["openSessions"] == 6


async def test_missing_cache_tier_is_a_condition_and_is_retried(cluster: Cluster, start_operator: Any) -> None:
    await start_operator()
    body = sample("inferencesession-minimal")
    body["spec"]["cacheTierRef"] = {"name": "later"}
    await cluster.create(body)
    cond = await eventually(lambda: cluster.condition("InferenceSession", "tiny", "CacheTierBound"))
    assert (cond["status"], cond["reason"]) == ("False", "NotFound")
    assert cluster.get("Deployment", "tiny") is None  # nothing is deployed against a tier that is not there
    assert status(cluster, "InferenceSession", "tiny")["phase"] == "Pending"

    tier = sample("cachetier-per-pod")
    tier["metadata"]["name"] = "later"
    await cluster.create(tier)
    await eventually(lambda: cluster.get("StatefulSet", "tiny"))  # per-pod claims: a StatefulSet
    await eventually(lambda: cluster.condition("InferenceSession", "tiny", "CacheTierBound")["status"] == "True")
    assert cluster.get("Deployment", "tiny") is None


async def test_cache_tier_deletion_waits_for_its_sessions(cluster: Cluster, start_operator: Any) -> None:
    await start_operator()
    await cluster.create(sample("cachetier-shared"))
    body = sample("inferencesession-minimal")
    body["spec"]["cacheTierRef"] = {"name": "shared-tier"}
    await cluster.create(body)
    await eventually(lambda: status(cluster, "CacheTier", "shared-tier").get("boundSessions") == ["tiny"])

    await cluster.delete("CacheTier", "shared-tier")
    await eventually(lambda: status(cluster, "CacheTier", "shared-tier").get("phase") == "Terminating")
    in_use = await eventually(lambda: (c := cluster.condition("CacheTier", "shared-tier", "InUse"))
                              and c["reason"] == "DeletionBlocked" and c)
    assert "tiny" in in_use["message"]
    await eventually(lambda: any(e["reason"] == "DeletionBlocked" for e in events(cluster)))
    await eventually(lambda: cluster.condition("InferenceSession", "tiny", "CacheTierBound")["reason"]
                     == "CacheTierTerminating")
    assert cluster.get("CacheTier", "shared-tier") is not None  # held by its finalizer, not gone

    await cluster.delete("InferenceSession", "tiny")
    await eventually(lambda: cluster.get("CacheTier", "shared-tier") is None)
    await eventually(lambda: cluster.get("PersistentVolumeClaim", "shared-tier-storage") is None)


async def test_restart_makes_no_changes(cluster: Cluster, start_operator: Any) -> None:
    first = await start_operator(service_monitors=True)
    await cluster.create(sample("cachetier-shared"))
    session = await cluster.create(chat_session())
    uid = session["metadata"]["uid"]
    await eventually(lambda: len(owned(cluster, uid)) == 13)
    await eventually(lambda: status(cluster, "CacheTier", "shared-tier").get("boundSessions") == ["chat"])
    await eventually(lambda: status(cluster, "InferenceSession", "chat").get("conditions"))
    await first.stop()

    snapshot = {key: copy.deepcopy(obj) for key, obj in owned(cluster, uid).items()}
    writes_before = len(cluster.writes())
    second = await start_operator(service_monitors=True)
    # Let the new operator resume both objects and run a few status ticks.
    await eventually(lambda: any(r.method == "GET" and r.url.path.endswith("/deployments")  # its watch cache
                                 for r in list(cluster.kmock)[writes_before:]), timeout=5)
    await asyncio.sleep(1.5)
    await second.stop()
    after = owned(cluster, uid)
    assert after == snapshot  # same objects, same content: no duplicates, no changes
    child_writes = [(m, p) for m, p in cluster.writes()[writes_before:]
                    if not p.endswith(("/events", "/status")) and "/inferencesessions/" not in p
                    and "/cachetiers/" not in p]
    assert child_writes == []


async def test_unsupported_and_invalid_settings_degrade_without_crashing(kmock: Any, start_operator: Any) -> None:
    # KEDA is not installed in this cluster (answered as a real API server answers an unknown
    # resource: 404 without object details), and the API server refuses one session's Deployment.
    register_resources(kmock, optional=())
    cluster = Cluster(kmock)
    kmock[re.compile(r"/apis/keda\.sh/.*")] << kmock_lib.Response(status=404, payload={
        "kind": "Status", "reason": "NotFound", "message": "the server could not find the requested resource",
        "details": {}})
    kmock.refuse("PATCH", "/apis/apps/v1/namespaces/llm/deployments/broken", 422, "Invalid",
                 "spec.template.spec.affinity: Invalid value")
    await start_operator()
    keda = sample("inferencesession-keda")
    keda["spec"].pop("cacheTierRef")
    await cluster.create(keda)
    broken = sample("inferencesession-minimal")
    broken["metadata"]["name"] = "broken"
    broken["spec"]["placement"] = {"affinity": {"nodeAffinity": {"bogus": True}}}
    await cluster.create(broken)

    cond = await eventually(lambda: (c := cluster.condition("InferenceSession", "agents", "Autoscaling"))
                            and c["reason"] == "KedaNotInstalled" and c)
    assert cond["status"] == "False"
    assert cluster.get("Deployment", "agents") is not None  # the session itself still runs
    degraded = await eventually(lambda: (c := cluster.condition("InferenceSession", "broken", "Degraded"))
                                and c["status"] == "True" and c)
    assert degraded["reason"] == "InvalidChild" and "affinity" in degraded["message"]
    assert status(cluster, "InferenceSession", "broken")["phase"] == "Degraded"
    # Refused, the Deployment does not exist, and later ticks keep saying so.
    await asyncio.sleep(1.0)  # > 3 status ticks
    assert cluster.condition("InferenceSession", "broken", "Degraded")["status"] == "True"
    assert cluster.get("Deployment", "broken") is None
    # The other children of the broken session were still applied.
    assert cluster.get("Service", "broken") is not None


async def test_spec_changes_replace_and_prune_children(cluster: Cluster, start_operator: Any) -> None:
    await start_operator()
    await cluster.create(sample("cachetier-shared"))
    await cluster.create(sample("cachetier-per-pod"))
    session = await cluster.create(chat_session())
    uid = session["metadata"]["uid"]
    await eventually(lambda: cluster.get("Deployment", "chat-router") and cluster.get("Deployment", "chat"))

    # Per-pod storage needs a StatefulSet; the router and the HPA are switched off.
    await cluster.update_spec("InferenceSession", "chat", {"cacheTierRef": {"name": "local-nvme"},
                                                           "router": {"enabled": False},
                                                           "autoscaling": {"enabled": False}})
    await eventually(lambda: cluster.get("StatefulSet", "chat"))
    # The Deployment serves until the StatefulSet does (tests/operator/test_migration.py has the steps).
    await eventually(lambda: set(owned(cluster, uid)) == {
        ("ConfigMap", "chat-config"), ("Service", "chat"), ("Service", "chat-headless"), ("Deployment", "chat"),
        ("StatefulSet", "chat"), ("PodDisruptionBudget", "chat")})
    await cluster.patch("StatefulSet", "chat", {"status": {"replicas": 1, "readyReplicas": 1}}, sub="status")
    await eventually(lambda: set(owned(cluster, uid)) == {
        ("ConfigMap", "chat-config"), ("Service", "chat"), ("Service", "chat-headless"),
        ("StatefulSet", "chat"), ("PodDisruptionBudget", "chat")})
    assert cluster.get("Service", "chat")["spec"]["selector"] == names.server_selector("chat")
    await eventually(lambda: status(cluster, "InferenceSession", "chat").get("workload") == "StatefulSet/chat")
    assert "router" not in status(cluster, "InferenceSession", "chat")  # switched off
    await eventually(lambda: status(cluster, "CacheTier", "local-nvme").get("boundSessions") == ["chat"])
    await eventually(lambda: status(cluster, "CacheTier", "shared-tier").get("boundSessions") == [])


async def test_cache_tier_ready_once_its_storage_is_real_with_the_occupancy_pods_report(
        cluster: Cluster, start_operator: Any) -> None:
    # A server pod's /metrics (names from docs/server-interface.md); `degraded` flips its storage tier off.
    state = {"degraded": 0}

    async def metrics(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text=(
            "# TYPE mambaserve_cache_tier_used_bytes gauge\n"
            'mambaserve_cache_tier_used_bytes{tier="host"} 1073741824\n'
            'mambaserve_cache_tier_used_bytes{tier="storage"} 107374182400\n'
            "# TYPE mambaserve_cache_tier_capacity_bytes gauge\n"
            'mambaserve_cache_tier_capacity_bytes{tier="host"} 34359738368\n'
            'mambaserve_cache_tier_capacity_bytes{tier="storage"} 456340275200\n'
            "# TYPE mambaserve_cache_storage_degraded gauge\n"
            f"mambaserve_cache_storage_degraded {state['degraded']}\n"))
    async with metrics_stub(metrics) as port:
        await start_operator()
        await cluster.create(sample("cachetier-shared"))
        # The claim exists but no volume is bound yet: not Ready, and it says why.
        ready = await eventually(lambda: (c := cluster.condition("CacheTier", "shared-tier", "Ready")) and c)
        assert (ready["status"], ready["reason"]) == ("False", "ClaimPending")
        assert status(cluster, "CacheTier", "shared-tier")["phase"] == "Pending"
        await cluster.patch("PersistentVolumeClaim", "shared-tier-storage", {"status": {"phase": "Bound"}}, sub="status")
        await eventually(lambda: cluster.condition("CacheTier", "shared-tier", "Ready")["status"] == "True")
        assert cluster.condition("CacheTier", "shared-tier", "Degraded")["status"] == "False"

        body = sample("inferencesession-minimal")
        body["spec"]["cacheTierRef"] = {"name": "shared-tier"}
        await cluster.create(body)
        # two pods on the one shared claim: storage counted once, host memory twice
        await create_ready_pods(cluster, port)
        occupancy = await eventually(lambda: (o := status(cluster, "CacheTier", "shared-tier").get("occupancy"))
                                     and o.get("reportingPods") == 2 and o)
        assert occupancy["host"] == {"usedBytes": 2 * 2**30, "capacityBytes": 64 * 2**30, "usedFraction": 0.0312}
        assert occupancy["storage"] == {"usedBytes": 100 * 2**30, "capacityBytes": 425 * 2**30,
                                        "usedFraction": 0.2353}
        assert "storage 100.0 GiB of 425.0 GiB used" in cluster.condition("CacheTier", "shared-tier", "Ready")["message"]
        assert admit(load_crd("cachetiers"), cluster.get("CacheTier", "shared-tier"))[1] == []

        # A server that lost its storage directory says so; the tier reports it instead of looking fine.
        state["degraded"] = 1
        degraded = await eventually(lambda: (c := cluster.condition("CacheTier", "shared-tier", "Degraded"))
                                    and c["status"] == "True" and c)
        assert degraded["reason"] == "StorageUnavailable" and "tiny-0, tiny-1" in degraded["message"]
        assert status(cluster, "CacheTier", "shared-tier")["phase"] == "Degraded"


async def test_a_kubectl_edit_of_the_server_image_or_args_is_reverted(cluster: Cluster, start_operator: Any) -> None:
    """Drift is judged on the live object's fields, not on the spec-hash annotation an edit leaves alone."""
    await start_operator()
    await cluster.create(sample("inferencesession-minimal"))
    dep = await eventually(lambda: cluster.get("Deployment", "tiny"))
    rendered = dep["spec"]["template"]["spec"]["containers"][0]
    edited = {**rendered, "image": "registry.example/other:1", "args": [*rendered["args"], "--log-level", "debug"]}
    await cluster.patch("Deployment", "tiny", {"spec": {"template": {"spec": {"containers": [edited]}}}})
    assert cluster.get("Deployment", "tiny")["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.example/other:1"
    server = lambda: cluster.get("Deployment", "tiny")["spec"]["template"]["spec"]["containers"][0]  # noqa: E731
    await eventually(lambda: server()["image"] == rendered["image"] and server()["args"] == rendered["args"])
    owners = {e["manager"] for e in cluster.get("Deployment", "tiny")["metadata"]["managedFields"]
              if e["operation"] == "Apply"}
    assert owners == {"mambaserve-operator"}
