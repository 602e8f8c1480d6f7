"""The autoscaling signal against reality: a live server under two kinds of traffic, scraped by a
real Prometheus, and the exact queries the operator renders (KEDA trigger, prometheus-adapter rule)
evaluated over each phase, then fed to the HPA's replica formula.

- Compulsory misses: every prompt is new. The raw miss ratio is ~1 (the old signal would have asked
  for maxReplicas), but more cache cannot help, and the capacity-miss ratio stays 0: no scaling.
- Capacity misses: prompts cycle through more prefixes than the server has state slots, so each
  one was cached and evicted before it comes back. More replicas (more cache) would hit them: the
  capacity-miss ratio is well above its target and the formula asks for more replicas.

Kubernetes' HPA controller itself does not run here (no API server); its documented rule does:
desired = ceil(current * value / target), unchanged within a 10% tolerance, clamped to min/max.
"""

from __future__ import annotations

import math
import random
import subprocess
import time
from typing import Any

import httpx
import pytest

from mambaserve.operator.builders.autoscaling import (RATE_WINDOW, adapter_rules, build_hpa, build_scaled_object,
                                                      queue_query)
from mambaserve.operator.settings import OperatorSettings
from mambaserve.operator.spec import parse_session
from tests.charts.live_stack import BIN, SERVER_LABELS, Prometheus, _stop, free_port, model_dir, wait_http
from tests.operator.conftest import sample

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron sigma tau upsilon phi chi psi "
         "omega").split()
SLOTS = 4  # the server's state slots: 8 cycled prompts do not fit
CYCLED = 8


def hpa_desired(current: int, value: float, target: float, low: int, high: int, tolerance: float = 0.1) -> int:
    """The HPA's replica rule for one metric (kubernetes.io/docs: Horizontal Pod Autoscaling)."""
    ratio = value / target
    desired = current if abs(ratio - 1.0) <= tolerance else math.ceil(current * ratio)
    return max(low, min(high, desired))


def session() -> Any:
    body = sample("inferencesession-autoscaled")  # chat in llm: the labels the live scrape attaches
    body["metadata"].update({"uid": "uid-chat", "generation": 1})
    return parse_session(body)


def windowed(query: str, seconds: int) -> str:
    # The operator's 2m window would mix both phases of a test this short; the expression is the same.
    assert f"[{RATE_WINDOW}]" in query
    return query.replace(f"[{RATE_WINDOW}]", f"[{seconds}s]")


def adapter_query() -> str:
    """The adapter rule for the HPA's capacity-miss metric, filled in as the adapter does for the pod."""
    rule = adapter_rules()["rules"][0]
    series = rule["seriesQuery"].split("{")[0]
    return (rule["metricsQuery"].replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", f'namespace="llm",pod="{SERVER_LABELS["pod"]}"').replace("<<.GroupBy>>", "pod"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    workdir = tmp_path_factory.mktemp("autoscaling-signal")
    port = free_port()
    server = subprocess.Popen(
        [str(BIN / "mambaserve"), "serve", "--model", str(model_dir(workdir)), "--port", str(port),
         "--mamba-cache-size", str(SLOTS), "--max-running-requests", "1", "--context-length", "2048",
         "--session-snapshot-dir", str(workdir / "snapshots"), "--log-level", "warning"],
        stdout=(workdir / "server.log").open("wb"), stderr=subprocess.STDOUT)
    prometheus = None
    try:
        prometheus = Prometheus(workdir, {"llm/mambaserve-servers": (f"127.0.0.1:{port}", SERVER_LABELS)}, [])
        wait_http(f"http://127.0.0.1:{port}/health", 120, server)
        yield f"http://127.0.0.1:{port}", prometheus
    finally:
        _stop(server)
        if prometheus is not None:
            prometheus.stop()


def _phase(client: httpx.Client, model: str, prompts: list[str]) -> tuple[float, float]:
    time.sleep(2.5)  # idle scrapes on both sides: each phase's window holds its own traffic only
    start = time.time()
    for prompt in prompts:
        r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
    end = time.time()
    time.sleep(2.5)
    return start, end


def _value(prometheus: Prometheus, query: str, start: float, end: float) -> float:
    at = end + 2.0
    result = prometheus.api("query", query=windowed(query, math.ceil(at - start) + 1), time=at)["result"]
    assert len(result) == 1, (query, result)
    return float(result[0]["value"][1])


def test_capacity_misses_scale_and_compulsory_misses_do_not(stack: Any) -> None:
    url, prometheus = stack
    rng = random.Random(7)
    s = session()
    scaling = s.autoscaling
    workload = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "chat"}}
    keda_query = build_scaled_object(s, workload, OperatorSettings())["spec"]["triggers"][0]["metadata"]["query"]
    hpa_target = build_hpa(s, workload)["spec"]["metrics"][0]["pods"]["target"]["averageValue"]
    assert hpa_target == f"{round(scaling.target_capacity_miss_ratio * 1000)}m"
    raw_miss = keda_query.replace("mambaserve_prefix_cache_capacity_miss_tokens_total",
                                  "mambaserve_prefix_cache_hit_tokens_total")  # hits / queried
    with httpx.Client(base_url=url, timeout=60) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        fresh = [" ".join(f"{rng.choice(WORDS)}{rng.randrange(10**6)}" for _ in range(12)) for _ in range(12)]
        compulsory = _phase(client, model, fresh)
        cycled = [f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(20)) for i in range(CYCLED)]
        capacity = _phase(client, model, cycled * 2)

    # Fresh prompts: nearly every token misses, yet none of it is a capacity miss.
    assert 1 - _value(prometheus, raw_miss, *compulsory) > 0.9
    for query in (keda_query, adapter_query()):
        value = _value(prometheus, query, *compulsory)
        assert value == 0.0, query
        assert hpa_desired(scaling.min_replicas, value, scaling.target_capacity_miss_ratio,
                           scaling.min_replicas, scaling.max_replicas) == scaling.min_replicas

    # Cycled prompts: their second round finds every prefix evicted for space.
    for query in (keda_query, adapter_query()):
        value = _value(prometheus, query, *capacity)
        assert value > 3 * scaling.target_capacity_miss_ratio, (query, value)
        desired = hpa_desired(scaling.min_replicas, value, scaling.target_capacity_miss_ratio,
                              scaling.min_replicas, scaling.max_replicas)
        assert desired > scaling.min_replicas, (value, desired)

    # The second signal (queue depth) is there too, and an idle server has nothing waiting.
    [series] = prometheus.query(queue_query(s))
    assert float(series["value"][1]) == 0.0
