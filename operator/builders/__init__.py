"""Pure builders: typed specs in, Kubernetes manifests (plain dicts) out. No I/O here."""

from __future__ import annotations

import dataclasses
from typing import Any

from mambaserve.operator.builders.autoscaling import adapter_rules, build_hpa, build_scaled_object
from mambaserve.operator.builders.config import build_config_map
from mambaserve.operator.builders.disruption import build_pdb
from mambaserve.operator.builders.model import build_model_claim, build_model_job, uses_cache
from mambaserve.operator.builders.monitoring import build_router_monitor, build_service_monitor
from mambaserve.operator.builders.network import build_network_policy
from mambaserve.operator.builders.router import (build_router_deployment, build_router_pdb, build_router_role,
                                                 build_router_role_binding, build_router_service_account, routing)
from mambaserve.operator.builders.server import build_workload, memory_footprint, problems, rollout, server_args
from mambaserve.operator.builders.services import build_client_service, build_headless_service, service_url
from mambaserve.operator.builders.storage import build_kernel_claim, build_tier_claim
from mambaserve.operator.settings import OperatorSettings
from mambaserve.operator.spec import CacheTier, InferenceSession

__all__ = ["Scale", "adapter_rules", "build_session_children", "build_tier_claim", "default_scale", "manual_replicas",
           "memory_footprint", "problems", "rollout", "routing", "server_args", "service_url", "uses_cache"]


@dataclasses.dataclass(frozen=True)
class Scale:
    """Who sets the workload's replicas: the autoscaler (rendered, and the field left to it), or the
    operator at ``replicas`` (None: the session's own count)."""
    autoscaler: bool
    replicas: int | None = None


def default_scale(session: InferenceSession) -> Scale:
    """What a session asks for when its autoscaler's metrics flow (``render`` assumes they do)."""
    return Scale(autoscaler=session.autoscaling.enabled)


def manual_replicas(session: InferenceSession) -> int:
    """spec.replicas, inside the autoscaling bounds while the autoscaler is withheld."""
    scaling = session.autoscaling
    if scaling.enabled:
        return max(scaling.min_replicas, min(scaling.max_replicas, session.replicas))
    return session.replicas


def build_session_children(session: InferenceSession, tier: CacheTier | None, settings: OperatorSettings,
                           scale: Scale | None = None) -> list[dict[str, Any]]:
    """Every object the session should own right now, in the order they are applied.

    Anything the session owns that is not in this list is stale and gets deleted.
    """
    scale = scale or default_scale(session)
    replicas = None if scale.autoscaler else (manual_replicas(session) if scale.replicas is None else scale.replicas)
    workload = build_workload(session, tier, settings, replicas)
    children = []
    if uses_cache(session):
        # Before the workload: its pods mount the claim and wait for the Job's download.
        children += [build_model_claim(session), build_model_job(session, session.image or settings.server_image)]
    kernels = build_kernel_claim(session)
    if kernels is not None:
        children.append(kernels)  # before the workload whose pods mount it
    children += [
        build_config_map(session, tier),
        build_headless_service(session),
        workload,
        build_client_service(session),
        build_pdb(session),
    ]
    if session.router.enabled:
        children += [
            build_router_service_account(session),
            build_router_role(session),
            build_router_role_binding(session),
            build_router_deployment(session, settings),
            build_router_pdb(session),
        ]
    if scale.autoscaler:
        if session.autoscaling.engine == "keda":
            children.append(build_scaled_object(session, workload, settings))
        else:
            children.append(build_hpa(session, workload))
    if settings.network_policies:
        children.append(build_network_policy(session, settings))
    if settings.service_monitors and session.monitoring.enabled:
        children.append(build_service_monitor(session, settings))
        if session.router.enabled:
            children.append(build_router_monitor(session, settings))
    return children
