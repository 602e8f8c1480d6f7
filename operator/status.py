"""Observed state of a session: its pods' /metrics, or its workload's status when metrics are unreachable."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from mambaserve.operator.settings import SERVER_PORT

HIT_RATE = "mambaserve_cache_hit_rate"
SESSIONS_OPEN = "mambaserve_sessions_open"
# Occupancy of the tiers below the GPU, labelled tier="host|storage" (docs/server-interface.md).
TIER_USED = "mambaserve_cache_tier_used_bytes"
TIER_CAPACITY = "mambaserve_cache_tier_capacity_bytes"
# 1 while a server has switched its storage tier off (directory full, read-only or gone).
STORAGE_DEGRADED = "mambaserve_cache_storage_degraded"


@dataclasses.dataclass(frozen=True)
class PodMetrics:
    pod: str
    cache_hit_rate: float | None
    sessions_open: int | None
    tier_used: Mapping[str, float] = dataclasses.field(default_factory=dict)
    tier_capacity: Mapping[str, float] = dataclasses.field(default_factory=dict)
    storage_degraded: bool | None = None


@dataclasses.dataclass(frozen=True)
class Observed:
    replicas: int
    ready_replicas: int
    updated_replicas: int
    cache_hit_rate: float | None
    open_sessions: int | None
    source: str  # metrics | workload


def parse_metrics(pod: str, text: str) -> PodMetrics:
    hit_rate: float | None = None
    sessions: int | None = None
    used: dict[str, float] = {}
    capacity: dict[str, float] = {}
    degraded: bool | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isnan(sample.value):
                continue
            if sample.name == HIT_RATE:
                hit_rate = float(sample.value)
            elif sample.name == SESSIONS_OPEN:
                sessions = int(sample.value)
            elif sample.name == TIER_USED and "tier" in sample.labels:
                used[sample.labels["tier"]] = float(sample.value)
            elif sample.name == TIER_CAPACITY and "tier" in sample.labels:
                capacity[sample.labels["tier"]] = float(sample.value)
            elif sample.name == STORAGE_DEGRADED:
                degraded = sample.value >= 1
    return PodMetrics(pod, hit_rate, sessions, used, capacity, degraded)


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = SERVER_PORT
    # Scrape the port the pod declares, so the operator follows the pod spec rather than a constant.
    for container in (pod.get("spec") or {}).get("containers") or ():
        for p in container.get("ports") or ():
            if p.get("name") == "http" and p.get("containerPort"):
                port = int(p["containerPort"])
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/metrics"


async def scrape(pods: Sequence[Mapping[str, Any]], timeout: float) -> list[PodMetrics]:
    """Metrics of every ready pod that answered; pods that did not answer are left out."""
    ready = [(p["metadata"]["name"], metrics_url(p)) for p in pods if pod_is_ready(p)]
    targets = [(name, url) for name, url in ready if url]
    if not targets:
        return []
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=client_timeout) as client:
        async def one(name: str, url: str) -> PodMetrics | None:
            try:
                async with client.get(url) as response:
                    if response.status != 200:
                        return None
                    return parse_metrics(name, await response.text())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return None
        results = await asyncio.gather(*(one(name, url) for name, url in targets))
    return [r for r in results if r is not None]


def observe(workload: Mapping[str, Any] | None, scraped: Sequence[PodMetrics]) -> Observed:
    status = (workload or {}).get("status") or {}
    replicas = int(status.get("replicas") or 0)
    ready = int(status.get("readyReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    rates = [m.cache_hit_rate for m in scraped if m.cache_hit_rate is not None]
    sessions = [m.sessions_open for m in scraped if m.sessions_open is not None]
    if not scraped:
        return Observed(replicas, ready, updated, None, None, "workload")
    # Each pod's gauge is already a sliding-window rate; the plain mean treats pods alike.
    hit_rate = round(sum(rates) / len(rates), 4) if rates else None
    return Observed(replicas, ready, updated, hit_rate, sum(sessions) if sessions else None, "metrics")


@dataclasses.dataclass(frozen=True)
class TierOccupancy:
    """What the pods of a tier's sessions report about the tiers below the GPU."""
    pods: int  # pods that answered
    host_used: float | None
    host_capacity: float | None
    storage_used: float | None
    storage_capacity: float | None
    storage_off: tuple[str, ...]  # pods that switched their storage tier off

    def as_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"reportingPods": self.pods}
        for tier, used, cap in (("host", self.host_used, self.host_capacity),
                                ("storage", self.storage_used, self.storage_capacity)):
            entry: dict[str, Any] = {}
            if used is not None:
                entry["usedBytes"] = int(used)
            if cap is not None:
                entry["capacityBytes"] = int(cap)
            if used is not None and cap:
                entry["usedFraction"] = round(used / cap, 4)
            if entry:
                out[tier] = entry
        return out


def tier_occupancy(scraped: Sequence[PodMetrics], shared_storage: bool) -> TierOccupancy:
    """Host tiers are per pod (summed). A shared storage claim is one directory that every pod
    reports on, so the largest report is the directory's; per-pod claims are summed."""
    def total(values: list[float]) -> float | None:
        return sum(values) if values else None

    def one(values: list[float]) -> float | None:
        return max(values) if values else None

    host_used = [m.tier_used["host"] for m in scraped if "host" in m.tier_used]
    host_cap = [m.tier_capacity["host"] for m in scraped if "host" in m.tier_capacity]
    st_used = [m.tier_used["storage"] for m in scraped if "storage" in m.tier_used]
    st_cap = [m.tier_capacity["storage"] for m in scraped if "storage" in m.tier_capacity]
    storage = one if shared_storage else total
    return TierOccupancy(len(scraped), total(host_used), total(host_cap), storage(st_used), storage(st_cap),
                         tuple(sorted(m.pod for m in scraped if m.storage_degraded)))
