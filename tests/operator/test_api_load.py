"""What a session at rest costs the API server: counted in the emulator's request log, which records every
request the operator makes (a watch stream that stays open is one request, once). Before the operator read
from watch streams, the same scene cost 27 requests per session reconcile (every child fetched, every child
kind listed for pruning, the pods, the tier)."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import pytest

from tests.operator.conftest import Cluster, eventually, sample

pytestmark = pytest.mark.asyncio

TICK = 0.2  # the operator's status interval here (15 s by default)


def chat() -> dict[str, Any]:
    body = sample("inferencesession-autoscaled")
    body["spec"]["model"].pop("tokenSecretRef")
    return body


def tally(requests: list[Any]) -> dict[str, int]:
    """Requests by verb and resource (discovery left out)."""
    out: collections.Counter[str] = collections.Counter()
    for r in requests:
        if r.resource is not None:
            out[f"{r.action.value if r.action else r.method.value} {r.resource.plural}"] += 1
    return dict(sorted(out.items()))


async def test_a_session_at_rest_costs_the_api_server_nothing(cluster: Cluster, start_operator: Any) -> None:
    op = await start_operator(status_interval=TICK, service_monitors=True)
    await cluster.create(sample("cachetier-shared"))
    await cluster.create(chat())
    await cluster.create(sample("inferencesession-minimal"))
    await eventually(lambda: cluster.get("PersistentVolumeClaim", "shared-tier-storage"))
    await cluster.patch("PersistentVolumeClaim", "shared-tier-storage", {"status": {"phase": "Bound"}}, sub="status",
                        manager="persistentvolume-controller")
    await eventually(lambda: all((cluster.get("InferenceSession", n) or {}).get("status", {}).get("conditions")
                                 for n in ("chat", "tiny")))
    await asyncio.sleep(10 * TICK)  # settle: every status written, every child in sync

    before, reconciles = len(list(cluster.kmock)), session_reconciles(op)
    await asyncio.sleep(15 * TICK)
    at_rest = [r for r in list(cluster.kmock)[before:] if "kmock" not in r.headers.get("User-Agent", "")]
    counts, ticks = tally(at_rest), session_reconciles(op) - reconciles
    print(f"\n{ticks:.0f} session reconciles at rest (2 sessions, 1 tier): {counts}, "
          f"{sum(counts.values()) / max(ticks, 1):.1f} requests per session reconcile")
    assert ticks >= 10  # the status timers ran
    assert counts == {}, [f"{r.method.value} {r.url.path_qs}" for r in at_rest[:20]]


def session_reconciles(op: Any) -> float:
    return op.metrics.registry.get_sample_value("mambaserve_operator_reconciles_total",
                                                {"kind": "InferenceSession", "result": "ok"}) or 0.0
