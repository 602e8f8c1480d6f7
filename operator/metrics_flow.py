"""Whether an autoscaler's metrics reach Prometheus for a session: the autoscaler is rendered only then.

Without a scrape the series do not exist: KEDA reads an empty answer as 0 and scales to minReplicas, an
HPA through prometheus-adapter gets nothing, and a status that said "Configured" hid it. The metrics
flow when one of these holds, checked in this order:

1. the operator's own ServiceMonitor scrapes the session (``--service-monitors``, ``spec.monitoring``);
2. the PodMonitor named by ``--server-pod-monitor`` (the chart's, ``NAMESPACE/NAME``) exists and selects
   the session's pods;
3. Prometheus (the session's ``autoscaling.prometheusAddress`` or ``--prometheus-url``) has the
   session's series.

Answers are remembered (a found series for 5 minutes, a missing one for 1), so the checks cost the API
server and Prometheus next to nothing; the ServiceMonitor check costs no request at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from mambaserve.operator import names
from mambaserve.operator.builders.autoscaling import series_selector
from mambaserve.operator.kube import ApiError, Kube
from mambaserve.operator.settings import OperatorSettings
from mambaserve.operator.spec import InferenceSession

FOUND_TTL = 300.0
MISSING_TTL = 60.0
# A series every serving pod exports from its start (docs/server-interface.md).
PROBE_METRIC = "mambaserve_prefix_cache_queried_tokens_total"


@dataclasses.dataclass(frozen=True)
class Flow:
    ok: bool
    message: str


def selects(monitor: Mapping[str, Any], namespace: str, pod_labels: Mapping[str, str]) -> bool:
    """Whether a PodMonitor's namespace and label selectors take pods with these labels in ``namespace``."""
    spec = monitor.get("spec") or {}
    ns = spec.get("namespaceSelector") or {}
    if not ns.get("any") and namespace not in (ns.get("matchNames")
                                               or [(monitor.get("metadata") or {}).get("namespace")]):
        return False
    wanted = (spec.get("selector") or {}).get("matchLabels") or {}
    return all(pod_labels.get(k) == v for k, v in wanted.items())


class MetricsFlow:
    def __init__(self, kube: Kube, settings: OperatorSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self._kube, self._settings, self._clock = kube, settings, clock
        self._answers: dict[tuple[str, ...], tuple[float, Any]] = {}

    async def check(self, session: InferenceSession) -> Flow:
        if self._settings.service_monitors and session.monitoring.enabled:
            return Flow(True, f"ServiceMonitor {session.name} scrapes the server pods")
        if self._settings.server_pod_monitor:
            monitor = await self._remembered(("monitor",), self._pod_monitor, lambda m: m is not None)
            if monitor is not None and selects(monitor, session.namespace, names.session_labels(session.name, "server")):
                return Flow(True, f"PodMonitor {self._settings.server_pod_monitor} scrapes the server pods")
        url = session.autoscaling.prometheus_address or self._settings.prometheus_url
        query = f"count({PROBE_METRIC}{{{series_selector(session)}}})"
        found, error = await self._remembered(("series", url, query), lambda: self._series(url, query),
                                              lambda answer: answer[0])
        if found:
            return Flow(True, f"Prometheus at {url} has the server pods' series")
        return Flow(False, "nothing scrapes the server pods: no ServiceMonitor (operator --service-monitors), no "
                           "PodMonitor selecting them (chart monitoring.serverPodMonitor or autoscaling.enabled), and "
                           f"Prometheus at {url} has no {PROBE_METRIC} series of the session"
                           + (f" ({error})" if error else ""))

    async def _remembered(self, key: tuple[str, ...], ask: Callable[[], Any], good: Callable[[Any], bool]) -> Any:
        now = self._clock()
        if key in self._answers and self._answers[key][0] > now:
            return self._answers[key][1]
        answer = await ask()
        self._answers[key] = (now + (FOUND_TTL if good(answer) else MISSING_TTL), answer)
        return answer

    async def _pod_monitor(self) -> dict[str, Any] | None:
        namespace, _, name = (self._settings.server_pod_monitor or "").partition("/")
        try:
            return await self._kube.get("PodMonitor", namespace, name)
        except ApiError:  # not installed, or not ours to read: not a scrape we can count on
            return None

    async def _series(self, url: str, query: str) -> tuple[bool, str]:
        timeout = aiohttp.ClientTimeout(total=self._settings.metrics_timeout)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as client:
                async with client.get(f"{url.rstrip('/')}/api/v1/query", params={"query": query}) as response:
                    body = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return False, f"it did not answer: {type(e).__name__} {e}".rstrip()
        if body.get("status") != "success":
            return False, f"it answered {body.get('errorType')}: {body.get('error')}"
        return bool((body.get("data") or {}).get("result")), ""
