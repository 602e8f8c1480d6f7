"""Scale-down order: the operator keeps each Deployment pod's pod-deletion-cost from its open sessions.

Each pod's /metrics is the server's own registry (ServerMetrics, the gauge the scheduler sets) on a loopback
port of its own; the operator runs for real against kmock's emulator."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import pytest
from prometheus_client import generate_latest

from mambaserve.operator import names
from mambaserve.operator.deletion_cost import ANNOTATION, changes, deletion_cost
from mambaserve.operator.status import PodMetrics
from mambaserve.server.engine.metrics import ServerMetrics
from tests.operator.conftest import Cluster, eventually, sample
from tests.operator.test_operator import metrics_stub

REPLICA_SET = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "tiny-5d8f7", "uid": "uid-rs",
               "controller": True}


def test_fewer_sessions_never_cost_more() -> None:
    costs = [deletion_cost(n) for n in range(0, 300)]
    assert costs == sorted(costs) and costs[0] == 0 and deletion_cost(1) == 1
    assert deletion_cost(3) < deletion_cost(4) and deletion_cost(4) == deletion_cost(7)  # doubling buckets
    assert deletion_cost(-1) == 0


def _pod(name: str, cost: str | None = None, owner: dict[str, Any] | None = REPLICA_SET) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "ownerReferences": [owner] if owner else []}
    if cost is not None:
        meta["annotations"] = {ANNOTATION: cost}
    return {"metadata": meta}


def test_only_moved_costs_of_replica_set_pods_are_written() -> None:
    pods = [_pod("a", "2"), _pod("b", "2"), _pod("c"), _pod("sts-0", owner={"kind": "StatefulSet"}), _pod("gone")]
    scraped = [PodMetrics("a", None, 3), PodMetrics("b", None, 8), PodMetrics("c", None, 0),
               PodMetrics("sts-0", None, 5), PodMetrics("gone", None, None)]
    # a stays in its bucket; b moved; c had none; a StatefulSet ignores the annotation; no gauge: left alone
    assert changes(pods, scraped) == {"b": "4", "c": "0"}


@contextlib.asynccontextmanager
async def server_metrics(sessions: int) -> AsyncIterator[tuple[int, ServerMetrics]]:
    """A loopback /metrics serving a server's registry with ``sessions`` open (yields its port, the metrics)."""
    metrics = ServerMetrics()
    metrics.sessions_open.set(sessions)

    async def page(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(body=generate_latest(metrics.registry), content_type="text/plain")
    async with metrics_stub(page) as port:
        yield port, metrics


def _cost(cluster: Cluster, pod: str) -> str | None:
    return (((cluster.get("Pod", pod) or {}).get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)


def _pod_patches(cluster: Cluster) -> int:
    return sum(1 for method, path in cluster.writes() if method == "PATCH" and "/pods/" in path)


def _first_removed(cluster: Cluster, pods: list[str]) -> str:
    """The ReplicaSet controller's pick among ready, running pods alike but for their cost: the lowest cost
    goes first (kubernetes.io/docs/concepts/workloads/controllers/replicaset/#pod-deletion-cost)."""
    return min(pods, key=lambda p: int(_cost(cluster, p) or 0))


@pytest.mark.asyncio
async def test_scale_down_removes_the_pod_with_fewer_sessions(cluster: Cluster, start_operator: Any) -> None:
    async with server_metrics(1) as (port_a, a), server_metrics(3) as (port_b, b):
        await start_operator()
        body = sample("inferencesession-minimal")
        body["spec"]["replicas"] = 2
        await cluster.create(body)
        await eventually(lambda: cluster.get("Deployment", "tiny"))
        for name, port in (("tiny-a", port_a), ("tiny-b", port_b)):
            await cluster.create({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": names.session_labels("tiny", "server"),
                             "ownerReferences": [REPLICA_SET]},
                "spec": {"containers": [{"name": "server", "ports": [{"name": "http", "containerPort": port}]}]},
                "status": {"phase": "Running", "podIP": "127.0.0.1",
                           "conditions": [{"type": "Ready", "status": "True"}]}})
        await eventually(lambda: (_cost(cluster, "tiny-a"), _cost(cluster, "tiny-b")) == ("1", "2"))
        await eventually(lambda: (s := (cluster.get("InferenceSession", "tiny") or {}).get("status") or {})
                         .get("openSessions") == 4)
        writes = _pod_patches(cluster)
        await asyncio.sleep(1.0)  # three status ticks: nothing moved, nothing written
        assert _pod_patches(cluster) == writes == 2

        # The sessions move: a new conversation lands on a, b's end. The costs follow.
        a.sessions_open.set(5)
        b.sessions_open.set(0)
        await eventually(lambda: (_cost(cluster, "tiny-a"), _cost(cluster, "tiny-b")) == ("3", "0"))

        # kubectl scale 2 -> 1: the operator sets the Deployment's replicas; the ReplicaSet then removes the
        # pod of lower cost, b, and a keeps its five sessions.
        await cluster.update_spec("InferenceSession", "tiny", {"replicas": 1})
        await eventually(lambda: cluster.get("Deployment", "tiny")["spec"]["replicas"] == 1)
        assert _first_removed(cluster, ["tiny-a", "tiny-b"]) == "tiny-b"
