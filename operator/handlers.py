"""Kopf handlers: thin wrappers that parse, reconcile (reconciler.py) and patch status."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from mambaserve.operator import reconciler
from mambaserve.operator.conditions import Event
from mambaserve.operator.kube import Kube, credentials
from mambaserve.operator.metrics import OperatorMetrics
from mambaserve.operator.metrics_flow import MetricsFlow
from mambaserve.operator.settings import GROUP, VERSION, OperatorSettings, configure_kopf

SESSIONS = (GROUP, VERSION, "inferencesessions")
TIERS = (GROUP, VERSION, "cachetiers")


def _post(body: Mapping[str, Any], events: list[Event]) -> None:
    for event in events:
        kopf.event(dict(body), type=event.type, reason=event.reason, message=event.message[:1024])


def _changed(body: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Skip status writes that would only move the scrape timestamp: one write per tick per
    session adds up, and an unchanged object should stay unchanged (e.g. across restarts)."""
    ignore = ("lastScrapeTime",)
    old = {k: v for k, v in (body.get("status") or {}).items() if k not in ignore}
    new = {k: v for k, v in status.items() if k not in ignore}
    return any(old.get(k) != v for k, v in new.items())


def connection_info(operator_settings: OperatorSettings, logger: Any, /, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """The API server and credentials: ``--api-server`` (development), else what Kopf finds (kwargs: Kopf's
    login handler arguments, its ``settings`` among them)."""
    if operator_settings.api_server:
        return kopf.ConnectionInfo(server=operator_settings.api_server, insecure=True, default_namespace="default")
    return credentials(logger, **kwargs)


def build_registry(settings: OperatorSettings, kube: Kube, metrics: OperatorMetrics) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, operator_settings)

    operator_settings = settings

    @kopf.on.login(registry=registry)
    def login(logger: logging.Logger, **kwargs: Any) -> kopf.ConnectionInfo | None:
        info = connection_info(operator_settings, logger, **kwargs)
        if info is not None:
            kube.login(info)
        return info

    # --- InferenceSession -------------------------------------------------------------------
    flow = MetricsFlow(kube, settings)  # remembers where autoscaling metrics were found

    async def reconcile_session(body: kopf.Body, patch: kopf.Patch) -> None:
        with metrics.track("InferenceSession"):
            outcome = await reconciler.reconcile_session(kube, body, operator_settings, flow)
        if _changed(body, outcome.status):
            patch.status.update(outcome.status)
        _post(body, outcome.events)
        tier = ((body.get("spec") or {}).get("cacheTierRef") or {}).get("name")
        if tier and outcome.status.get("cacheTier") == tier:
            await reconciler.sync_tier_bindings(kube, body["metadata"]["namespace"], tier)

    @kopf.on.resume(*SESSIONS, registry=registry)
    @kopf.on.create(*SESSIONS, registry=registry)
    @kopf.on.update(*SESSIONS, registry=registry)
    async def session_changed(body: kopf.Body, patch: kopf.Patch, old: Any = None, new: Any = None,
                              **_: Any) -> None:
        await reconcile_session(body, patch)
        old_tier = (((old or {}).get("spec") or {}).get("cacheTierRef") or {}).get("name")
        new_tier = (((new or {}).get("spec") or {}).get("cacheTierRef") or {}).get("name")
        if old_tier and old_tier != new_tier:
            await reconciler.sync_tier_bindings(kube, body["metadata"]["namespace"], old_tier)

    @kopf.timer(*SESSIONS, interval=settings.status_interval, initial_delay=settings.status_interval,
                registry=registry)
    async def session_tick(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        await reconcile_session(body, patch)

    # optional=True: Kopf adds no finalizer for the handler and runs it only if it sees the deletion.
    optional = not settings.finalizers

    @kopf.on.delete(*SESSIONS, registry=registry, optional=optional)
    async def session_deleted(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
        with metrics.track("InferenceSession"):
            deleted = await reconciler.finalize_session(kube, body)
        logger.info("deleted %d children: %s", len(deleted), ", ".join(f"{k}/{n}" for k, n in deleted))

    # --- CacheTier -----------------------------------------------------------------------------

    async def reconcile_tier(body: kopf.Body, patch: kopf.Patch) -> None:
        with metrics.track("CacheTier"):
            outcome = await reconciler.reconcile_tier(kube, body, operator_settings.metrics_timeout)
        if _changed(body, outcome.status):
            patch.status.update(outcome.status)
        _post(body, outcome.events)

    @kopf.on.resume(*TIERS, registry=registry)
    @kopf.on.create(*TIERS, registry=registry)
    @kopf.on.update(*TIERS, registry=registry)
    async def tier_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        await reconcile_tier(body, patch)
        # Sessions waiting for this tier (or using it) pick up the change now, not at their next tick.
        for session in await reconciler.sessions_for_tier(kube, body["metadata"]["namespace"],
                                                          body["metadata"]["name"]):
            with metrics.track("InferenceSession"):
                outcome = await reconciler.reconcile_session(kube, session, operator_settings, flow)
            await kube.patch_status("InferenceSession", session["metadata"]["namespace"],
                                    session["metadata"]["name"], outcome.status)
            _post(session, outcome.events)

    @kopf.timer(*TIERS, interval=settings.status_interval, initial_delay=settings.status_interval,
                registry=registry)
    async def tier_tick(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        await reconcile_tier(body, patch)

    @kopf.on.delete(*TIERS, registry=registry, optional=optional)
    async def tier_deleted(body: kopf.Body, **_: Any) -> None:
        with metrics.track("CacheTier"):
            blockers = await reconciler.finalize_tier(kube, body)
            if blockers:
                outcome = await reconciler.reconcile_tier(kube, body, operator_settings.metrics_timeout)
                await kube.patch_status("CacheTier", body["metadata"]["namespace"], body["metadata"]["name"],
                                        outcome.status)
                message = f"in use by InferenceSession {', '.join(blockers)}; deletion waits until they let go"
                kopf.warn(dict(body), reason="DeletionBlocked", message=message)
                raise kopf.TemporaryError(message, delay=operator_settings.tier_retry_delay)

    if not settings.finalizers:
        _timers_without_finalizer(registry)
    return registry


def _timers_without_finalizer(registry: kopf.OperatorRegistry) -> None:
    """Kopf gives every timer a finalizer (to stop it before the object goes) and has no option to
    say otherwise. Our timers only refresh status, and Kopf stops them anyway when the watch sees
    the object deleted, so without finalizers they need none. This reaches into Kopf's registry;
    tests/operator/test_finalizers.py fails if a Kopf upgrade adds the finalizer back."""
    spawning = registry._spawning  # noqa: SLF001
    spawning._handlers = [dataclasses.replace(h, requires_finalizer=False)  # noqa: SLF001
                          for h in spawning.get_all_handlers()]
