"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's ``leaderelection`` does it.

Several operator replicas run; the one holding the Lease reconciles (Kopf and the watch streams run only
there), the others wait as standbys and take over when it stops renewing. A holder renews every
``retry_period``; a standby takes the Lease once its record has not changed for ``lease_duration`` by
the standby's own clock (renew times are never compared across machines' clocks). A takeover is a JSON
patch that tests the resourceVersion it read, so two standbys never both win. A holder that cannot renew
within ``renew_deadline`` stops reconciling and exits (the pod restarts as a standby); one that stops
cleanly releases the Lease, so a rolling update hands over at once instead of after ``lease_duration``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any

from mambaserve.operator.kube import ApiError, Kube

log = logging.getLogger("mambaserve.operator.leader")


@dataclasses.dataclass(frozen=True)
class Timing:
    lease_duration: float = 15.0  # a standby takes over after the record stood still this long
    renew_deadline: float = 10.0  # a holder that could not renew for this long gives up
    retry_period: float = 2.0  # between renewals, and between a standby's looks


class LeadershipLost(Exception):
    pass


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElection:
    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, timing: Timing = Timing(),
                 clock: Callable[[], float] | None = None) -> None:
        self._kube, self.namespace, self.name, self.identity, self.timing = kube, namespace, name, identity, timing
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self._observed: tuple[Any, float] | None = None  # (the holder's record, when it last changed)

    def _spec(self, transitions: int, acquired: str | None = None) -> dict[str, Any]:
        now = _now()
        return {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, round(self.timing.lease_duration)),
                "acquireTime": acquired or now, "renewTime": now, "leaseTransitions": transitions}

    async def acquire(self) -> None:
        """Wait until this replica holds the Lease."""
        while not await self._try():
            await asyncio.sleep(self.timing.retry_period)
        log.info("%s holds the lease %s/%s: reconciling", self.identity, self.namespace, self.name)

    async def hold(self) -> None:
        """Renew until cancelled; LeadershipLost once a renewal has failed for the renew deadline."""
        last = self._clock()
        while True:
            await asyncio.sleep(self.timing.retry_period)
            try:
                if await self._try():
                    last = self._clock()
                    continue
                raise LeadershipLost(f"{self.identity} lost the lease {self.namespace}/{self.name} to another replica")
            except ApiError as e:
                log.warning("renewing the lease failed: %s", e)
            if self._clock() - last > self.timing.renew_deadline:
                raise LeadershipLost(f"{self.identity} could not renew the lease for {self.timing.renew_deadline:g} s")

    async def release(self) -> None:
        """Give the Lease up (a clean stop): a standby takes it at its next look."""
        lease = await self._kube.get("Lease", self.namespace, self.name)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        spec = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": _now()}
        try:
            await self._patch(lease, spec)
        except ApiError as e:
            log.warning("releasing the lease failed: %s", e)

    async def _try(self) -> bool:
        """One look: create, renew or take over the Lease where allowed; whether this replica holds it."""
        lease = await self._kube.get("Lease", self.namespace, self.name)
        if lease is None:
            try:
                await self._kube.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                         "metadata": {"name": self.name, "namespace": self.namespace},
                                         "spec": self._spec(transitions=0)})
                return True
            except ApiError as e:
                if e.status == 409:  # another replica created it first
                    return False
                raise
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        record = (holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        if self._observed is None or self._observed[0] != record:
            self._observed = (record, self._clock())
        duration = float(spec.get("leaseDurationSeconds") or self.timing.lease_duration)
        if holder == self.identity:
            new = self._spec(int(spec.get("leaseTransitions") or 0), spec.get("acquireTime"))
        elif holder and self._clock() - self._observed[1] < duration:
            return False  # held, and renewed within its duration as this replica saw it
        else:
            new = self._spec(int(spec.get("leaseTransitions") or 0) + 1)
        try:
            await self._patch(lease, new)
        except ApiError as e:
            if e.status in (409, 422):  # the resourceVersion moved: someone else wrote first
                return False
            raise
        return True

    async def _patch(self, lease: Mapping[str, Any], spec: Mapping[str, Any]) -> None:
        ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": lease["metadata"]["resourceVersion"]},
               {"op": "replace", "path": "/spec", "value": dict(spec)}]
        await self._kube.json_patch("Lease", self.namespace, self.name, ops)
