"""Autoscaling that cannot die silently: rendered only where its metrics reach Prometheus (a real one
here, scraping a stand-in of a server pod's /metrics), reported as MetricsMissing otherwise, and aimed at
the workload itself so that scaling goes on while the operator is down."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import aiohttp.web
import pytest

from mambaserve.operator import metrics_flow
from tests.charts.live_stack import Prometheus
from tests.operator.conftest import Cluster, eventually, sample
from tests.operator.test_operator import metrics_stub

pytestmark = pytest.mark.asyncio


def autoscaled() -> dict[str, Any]:
    body = sample("inferencesession-minimal")
    body["spec"]["replicas"] = 1
    body["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 2, "maxReplicas": 6}
    return body


async def test_no_autoscaler_until_the_metrics_flow(cluster: Cluster, start_operator: Any, tmp_path: pathlib.Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_flow, "MISSING_TTL", 0.2)  # look again soon (a minute in production)

    async def pod_metrics(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text="# TYPE mambaserve_prefix_cache_queried_tokens_total counter\n"
                                         "mambaserve_prefix_cache_queried_tokens_total 40\n")

    async with metrics_stub(pod_metrics) as port:
        # A real Prometheus that does not scrape the session yet (scrapes are set up below).
        prometheus = Prometheus(tmp_path, {}, [])
        try:
            await start_operator(prometheus_url=prometheus.url)
            await cluster.create(autoscaled())
            cond = await eventually(lambda: (c := cluster.condition("InferenceSession", "tiny", "Autoscaling"))
                                    and c["reason"] == "MetricsMissing" and c)
            assert cond["status"] == "False" and "nothing scrapes the server pods" in cond["message"]
            assert "replicas held at 2" in cond["message"]
            # No autoscaler that would read nothing; the workload holds spec.replicas within the bounds.
            assert cluster.get("HorizontalPodAutoscaler", "tiny") is None
            assert cluster.get("Deployment", "tiny")["spec"]["replicas"] == 2

            # The pods get scraped (labels as prometheus-operator's PodMonitor sets them): the HPA appears.
            prometheus.stop()
            prometheus = Prometheus(tmp_path, {"llm/mambaserve-servers": (
                f"127.0.0.1:{port}", {"namespace": "llm", "pod": "tiny-0", "mambaserve_io_session": "tiny"})}, [])
            await start_operator(prometheus_url=prometheus.url)
            cond = await eventually(lambda: (c := cluster.condition("InferenceSession", "tiny", "Autoscaling"))
                                    and c["status"] == "True" and c, timeout=20)
            assert cond["reason"] == "Configured" and "has the server pods' series" in cond["message"]
            hpa = await eventually(lambda: cluster.get("HorizontalPodAutoscaler", "tiny"))
            assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tiny"}
            # The replicas the operator had set were handed over to the HPA, not reset.
            assert cluster.get("Deployment", "tiny")["spec"]["replicas"] == 2
        finally:
            prometheus.stop()


async def test_the_charts_pod_monitor_counts_as_a_scrape(cluster: Cluster, start_operator: Any) -> None:
    await cluster.create({
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": {"name": "mambaserve-servers", "namespace": "mambaserve-system"},
        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/managed-by": "mambaserve-operator",
                                              "app.kubernetes.io/component": "server"}},
                 "namespaceSelector": {"matchNames": ["llm"]},
                 "podMetricsEndpoints": [{"port": "http"}]}})
    await start_operator(server_pod_monitor="mambaserve-system/mambaserve-servers",
                         prometheus_url="http://127.0.0.1:9")  # nothing answers there
    await cluster.create(autoscaled())
    cond = await eventually(lambda: (c := cluster.condition("InferenceSession", "tiny", "Autoscaling"))
                            and c["status"] == "True" and c)
    assert "PodMonitor mambaserve-system/mambaserve-servers scrapes the server pods" in cond["message"]
    await eventually(lambda: cluster.get("HorizontalPodAutoscaler", "tiny"))


async def test_scaling_goes_on_while_the_operator_is_down(cluster: Cluster, start_operator: Any) -> None:
    operator = await start_operator(service_monitors=True)
    await cluster.create(autoscaled())
    hpa = await eventually(lambda: cluster.get("HorizontalPodAutoscaler", "tiny"))
    # The HPA scales the workload, not the InferenceSession: nothing of the operator is in the loop.
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    await operator.stop()
    await cluster.patch("Deployment", "tiny", {"spec": {"replicas": 5}}, manager="horizontal-pod-autoscaler")
    await start_operator(service_monitors=True)
    await asyncio.sleep(1.5)  # the new operator resumed and ran status ticks
    assert cluster.get("Deployment", "tiny")["spec"]["replicas"] == 5
    assert cluster.condition("InferenceSession", "tiny", "Autoscaling")["status"] == "True"
