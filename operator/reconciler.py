"""Level-based reconciliation: desired children from the builders, applied through ``kube``, then status.

Every function here takes the whole current object and returns the whole status it should have;
Kopf handlers and timers call them the same way, so a missed event is repaired at the next tick.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mambaserve.operator import builders, conditions, deletion_cost, names
from mambaserve.operator.conditions import Condition, Event
from mambaserve.operator.kube import SESSION_CHILD_KINDS, ApiError, Kube, ResourceNotInstalled, owned_by
from mambaserve.operator.metrics_flow import MetricsFlow
from mambaserve.operator.pod_reasons import PRIORITY as POD_REASONS
from mambaserve.operator.pod_reasons import PodReason, diagnose
from mambaserve.operator.settings import OperatorSettings
from mambaserve.operator.spec import (CacheTier, InferenceSession, Problem, incompatibilities, parse_cache_tier,
                                      parse_session)
from mambaserve.operator.status import Observed, TierOccupancy, observe, scrape, tier_occupancy


@dataclasses.dataclass
class Outcome:
    status: dict[str, Any]
    events: list[Event] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Binding:
    tier: CacheTier | None
    condition: Condition

    @property
    def hold(self) -> bool:
        """Leave the children as they are: the tier they should use is not usable now."""
        return self.condition.status != "True" and self.condition.reason != "NotRequested"


async def bind(kube: Kube, session: InferenceSession) -> Binding:
    if session.cache_tier is None:
        return Binding(None, Condition("CacheTierBound", "False", "NotRequested",
                                       "no cacheTierRef: GPU state cache only"))
    body = await kube.get("CacheTier", session.namespace, session.cache_tier)
    if body is None:
        return Binding(None, Condition("CacheTierBound", "False", "NotFound",
                                       f"CacheTier {session.cache_tier} does not exist in {session.namespace}; "
                                       "waiting for it"))
    tier = parse_cache_tier(body)
    if tier.terminating:
        return Binding(None, Condition("CacheTierBound", "False", "CacheTierTerminating",
                                       f"CacheTier {tier.name} is being deleted; point cacheTierRef elsewhere"))
    bad = incompatibilities(session, tier)
    if bad:
        return Binding(None, Condition("CacheTierBound", "False", "Incompatible", "; ".join(p.message for p in bad)))
    return Binding(tier, Condition("CacheTierBound", "True", "Bound", f"using CacheTier {tier.name}"))


def _workload_kind(session: InferenceSession, tier: CacheTier | None) -> str:
    return "StatefulSet" if tier is not None and tier.storage.per_pod else "Deployment"


@dataclasses.dataclass(frozen=True)
class Migration:
    """A move between a Deployment and a StatefulSet (the tier's storage mode changed): the old workload
    serves until the new one does, within the rollout strategy's GPUs."""
    old: Mapping[str, Any]
    new: Mapping[str, Any] | None
    want: int  # replicas serving, old and new together
    new_replicas: int
    done: bool

    def describe(self) -> str:
        ready = int(((self.new or {}).get("status") or {}).get("readyReplicas") or 0)
        return (f"moving from {self.old['kind']}/{self.old['metadata']['name']} to the new workload: {ready}/"
                f"{self.want} new pods ready, the old one keeps serving until then")


def _replicas(workload: Mapping[str, Any] | None, default: int = 0) -> int:
    if workload is None:
        return default
    return int((workload.get("spec") or {}).get("replicas", 1))


def _ready(workload: Mapping[str, Any] | None) -> int:
    return int(((workload or {}).get("status") or {}).get("readyReplicas") or 0)


async def _migration(kube: Kube, session: InferenceSession, kind: str, autoscaled: bool) -> Migration | None:
    """The step of a workload migration due now, or None when there is none. Surge runs the new workload
    at full size beside the old one; Replace moves one pod at a time (the old workload scaled down by one
    once every new pod serves), so a full GPU pool never waits for a GPU the old pods hold."""
    other = "StatefulSet" if kind == "Deployment" else "Deployment"
    name = names.workload(session.name)
    old = await kube.get(other, session.namespace, name)
    if old is None or not owned_by(old, session.uid):
        return None
    new = await kube.get(kind, session.namespace, name)
    old_replicas, new_replicas = _replicas(old), _replicas(new)
    strategy, _ = builders.rollout(session)
    if not autoscaled:
        want = builders.manual_replicas(session)
    else:  # the count the autoscaler had reached, carried across
        want = old_replicas + (new_replicas if strategy == "Replace" else 0)
    if strategy == "Surge":
        return Migration(old, new, want, want, done=new is not None and _ready(new) >= want)
    if new is None or _ready(new) >= new_replicas:  # the new pods so far serve: free the next GPU
        if old_replicas > 0 and new_replicas + old_replicas >= want:
            old_replicas -= 1
            await kube.merge_patch(other, session.namespace, name, {"spec": {"replicas": old_replicas}})
    new_replicas = max(want - old_replicas, 0)
    return Migration(old, new, want, new_replicas, done=old_replicas == 0 and _ready(new) >= want)


async def _apply_children(kube: Kube, session: InferenceSession, tier: CacheTier | None,
                          settings: OperatorSettings, scale: builders.Scale,
                          migration: Migration | None = None) -> tuple[list[Problem], list[Event]]:
    """Apply every desired child (those of kinds the cluster does not serve left out); problems and events."""
    problems: list[Problem] = []
    events: list[Event] = []
    if migration is not None and not migration.done:
        scale = builders.Scale(autoscaler=False, replicas=migration.new_replicas)
    desired = builders.build_session_children(session, tier, settings, scale)
    for child in desired:
        kind, name = child["kind"], child["metadata"]["name"]
        try:
            applied = await kube.apply(child)
        except ResourceNotInstalled:
            continue
        except ApiError as e:
            if not e.invalid:
                raise  # transient (5xx, timeouts, 409 on update): Kopf retries the handler
            problems.append(Problem("InvalidChild", f"{kind} {name} was refused by the API server: {e.message}"))
            continue
        if applied.action in ("created", "recreated"):
            events.append(Event("Normal", applied.action.capitalize(), f"{applied.action} {kind} {name}"))
    keep = {(c["kind"], c["metadata"]["name"]) for c in desired}
    if migration is not None and not migration.done:
        keep.add((migration.old["kind"], migration.old["metadata"]["name"]))  # still serving
    deleted = await kube.prune(SESSION_CHILD_KINDS, session.namespace, {names.SESSION_LABEL: session.name},
                               session.uid, keep)
    events += [Event("Normal", "Deleted", f"deleted stale {kind} {name}") for kind, name in deleted]
    return problems, events


AUTOSCALER_KIND = {"keda": "ScaledObject", "hpa": "HorizontalPodAutoscaler"}


async def served(kube: Kube, kind: str, namespace: str) -> bool:
    try:
        await kube.list(kind, namespace)
        return True
    except ResourceNotInstalled:
        return False


async def _autoscaling(kube: Kube, session: InferenceSession, flow: MetricsFlow) -> tuple[builders.Scale, Condition]:
    """Whether the autoscaler is rendered (its kind served, its metrics flowing), and the condition saying so."""
    scaling = session.autoscaling
    if not scaling.enabled:
        return builders.Scale(False), Condition("Autoscaling", "False", "Disabled", "autoscaling.enabled is false")
    kind = AUTOSCALER_KIND[scaling.engine]
    held = f"replicas held at {builders.manual_replicas(session)}"
    if not await served(kube, kind, session.namespace):
        if scaling.engine == "keda":
            return builders.Scale(False), Condition("Autoscaling", "False", "KedaNotInstalled",
                                                    f"the keda.sh/v1alpha1 ScaledObject kind is not served by this "
                                                    f"cluster; {held}")
        return builders.Scale(False), Condition("Autoscaling", "False", "HPANotServed",
                                                f"autoscaling/v2 is not served by this cluster; {held}")
    metrics = await flow.check(session)
    if not metrics.ok:
        return builders.Scale(False), Condition("Autoscaling", "False", "MetricsMissing", f"{metrics.message}; {held}")
    engine = "KEDA ScaledObject" if scaling.engine == "keda" else "HorizontalPodAutoscaler"
    return builders.Scale(True), Condition(
        "Autoscaling", "True", "Configured",
        f"{engine} {session.name} scales the workload between {scaling.min_replicas} and {scaling.max_replicas} "
        f"replicas; {metrics.message}")


async def reconcile_session(kube: Kube, body: Mapping[str, Any], settings: OperatorSettings,
                            flow: MetricsFlow | None = None) -> Outcome:
    session = parse_session(body)
    previous = (body.get("status") or {}).get("conditions") or []
    binding = await bind(kube, session)
    problems = builders.problems(session, binding.tier)
    events: list[Event] = []
    scale, autoscaling = await _autoscaling(kube, session, flow or MetricsFlow(kube, settings))
    kind = _workload_kind(session, binding.tier)
    migration = None if binding.hold else await _migration(kube, session, kind, scale.autoscaler)
    if migration is not None and not migration.done and scale.autoscaler:
        autoscaling = Condition("Autoscaling", "False", "WorkloadMigration",
                                f"the autoscaler returns once the new workload serves; {migration.describe()}")
    if not binding.hold:
        apply_problems, events = await _apply_children(kube, session, binding.tier, settings, scale, migration)
        problems += apply_problems

    workload = await kube.get(kind, session.namespace, names.workload(session.name))
    if migration is not None and not migration.done:
        workload = _together(workload, migration.old)  # both serve: readiness counts both
    router = await kube.get("Deployment", session.namespace, names.router(session.name)) \
        if session.router.enabled else None
    pods = await kube.list("Pod", session.namespace, names.server_selector(session.name))
    scraped = await scrape(pods, settings.metrics_timeout)
    observed = observe(workload, scraped)
    await deletion_cost.keep(kube, session.namespace, pods, scraped)
    model = await _model_condition(kube, session)
    reasons = diagnose(workload, pods)
    if model is not None and model.status != "True":
        # The download's own pods (image pull, crash loop, scheduling) explain the wait too.
        reasons += [r for r in diagnose(None, await kube.list("Pod", session.namespace, _download_selector(session)))
                    if r.reason not in {x.reason for x in reasons}]

    if model is not None and model.status != "True" and not reasons:
        reasons = [PodReason("WaitingForModel", model.message)]
    if migration is not None and not migration.done:
        want = migration.want
    elif scale.autoscaler:
        want = _replicas(workload, session.autoscaling.min_replicas)
    else:
        want = builders.manual_replicas(session)
    readiness = _readiness(want, observed, workload is not None, binding, reasons)
    if migration is not None and not migration.done:
        readiness[1] = Condition("Progressing", "True", "WorkloadMigration", migration.describe())
    conds = [
        *readiness,
        _degraded(problems),
        binding.condition,
        _router_condition(session, router),
        *([model] if model is not None else []),
        autoscaling,
    ]
    merged = conditions.merge(previous, conds, session.generation)
    status = _session_status(session, binding, kind, observed, merged)
    return Outcome(status, events + conditions.transitions(previous, merged) + _pod_events(previous, merged))


def _together(new: Mapping[str, Any] | None, old: Mapping[str, Any]) -> dict[str, Any]:
    """The two workloads of a migration as one, for readiness: their pods serve side by side."""
    a, b = (new or {}).get("status") or {}, old.get("status") or {}
    return {"kind": old["kind"], "metadata": old["metadata"], "spec": {},
            "status": {key: int(a.get(key) or 0) + int(b.get(key) or 0)
                       for key in ("replicas", "readyReplicas", "updatedReplicas")}}


def _pod_events(previous: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[Event]:
    """One Warning event per new pod-level reason (or new message for it), named after the reason,
    so ``kubectl describe`` shows e.g. ImagePullFailed with the registry's words."""
    out: list[Event] = []
    for type_ in ("Ready", "Progressing"):
        now, before = conditions.find(current, type_), conditions.find(previous, type_)
        if now is None or now["reason"] not in POD_REASONS or now["reason"] == "WaitingForModel":
            continue
        if before is not None and (before.get("reason"), before.get("message")) == (now["reason"], now["message"]):
            continue
        event = Event("Warning", now["reason"], now["message"])
        if event not in out:
            out.append(event)
    return out


# Reasons that will not resolve by waiting: the rollout is stuck until someone acts.
STUCK = frozenset({"AdmissionRefused", "ImagePullFailed", "ContainerConfigError", "CrashLoopBackOff",
                   "ProgressDeadlineExceeded"})


def _explain(ready: int, want: int, reasons: list[PodReason]) -> tuple[str, str]:
    top = reasons[0]
    return top.reason, "; ".join([f"{ready}/{want} server pods ready", *(r.describe() for r in reasons)])


def _readiness(want: int, observed: Observed, exists: bool, binding: Binding,
               reasons: list[PodReason] | None = None) -> list[Condition]:
    """Ready and Progressing for ``want`` replicas (the autoscaler's count when it owns them)."""
    if not exists:
        reason = "WaitingForCacheTier" if binding.hold else "WorkloadMissing"
        return [Condition("Ready", "False", reason, "the server workload does not exist yet"),
                Condition("Progressing", "True" if not binding.hold else "False", reason, "")]
    if want == 0:
        return [Condition("Ready", "True", "ScaledToZero", "0 replicas requested"),
                Condition("Progressing", "False", "ScaledToZero", "")]
    ready = observed.ready_replicas >= want
    rolled = observed.updated_replicas >= want and observed.replicas == want
    msg = f"{observed.ready_replicas}/{want} server pods ready"
    if reasons and not (ready and rolled):
        # Not serving (or a rollout stuck behind failing pods): say why, in the pods' own words.
        reason, why = _explain(observed.ready_replicas, want, list(reasons))
        return [Condition("Ready", "True", "ReplicasReady", msg) if ready else Condition("Ready", "False", reason, why),
                Condition("Progressing", "False" if reason in STUCK else "True", reason, why)]
    return [
        Condition("Ready", "True" if ready else "False", "ReplicasReady" if ready else "ReplicasNotReady", msg),
        Condition("Progressing", "False" if ready and rolled else "True",
                  "Stable" if ready and rolled else "RollingOut", msg),
    ]


def _download_selector(session: InferenceSession) -> dict[str, str]:
    return {names.SESSION_LABEL: session.name, names.COMPONENT_LABEL: "model-download"}


async def _model_condition(kube: Kube, session: InferenceSession) -> Condition | None:
    """ModelReady from the download Job of a model cache; None when the session has no cache."""
    if not builders.uses_cache(session):
        return None
    job = await kube.get("Job", session.namespace, names.model_job(session.name))
    if job is None:
        return Condition("ModelReady", "False", "DownloadMissing", "the model download Job does not exist yet")
    return model_condition(job, session.model.source)


def model_condition(job: Mapping[str, Any], source: str) -> Condition:
    status = job.get("status") or {}
    for cond in status.get("conditions") or ():
        if cond.get("type") == "Failed" and cond.get("status") == "True":
            return Condition("ModelReady", "False", "DownloadFailed",
                             f"downloading {source} failed: {cond.get('reason') or ''}: {cond.get('message') or ''}")
    if int(status.get("succeeded") or 0) >= 1:
        return Condition("ModelReady", "True", "Downloaded", f"{source} is on the model cache claim")
    failed = int(status.get("failed") or 0)
    return Condition("ModelReady", "False", "Downloading",
                     f"downloading {source}" + (f" ({failed} failed attempts so far)" if failed else ""))


def _degraded(problems: list[Problem]) -> Condition:
    if not problems:
        return Condition("Degraded", "False", "AsExpected", "")
    return Condition("Degraded", "True", problems[0].reason, "; ".join(p.message for p in problems))


def _router_condition(session: InferenceSession, router: Mapping[str, Any] | None) -> Condition:
    if not session.router.enabled:
        return Condition("RouterReady", "False", "Disabled", "router.enabled is false")
    if router is None:
        return Condition("RouterReady", "False", "RouterMissing", "the router Deployment does not exist yet")
    ready = int((router.get("status") or {}).get("readyReplicas") or 0)
    ok = ready >= 1
    return Condition("RouterReady", "True" if ok else "False", "RouterAvailable" if ok else "RouterNotReady",
                     f"{ready}/{session.router.replicas} router pods ready")


def _session_status(session: InferenceSession, binding: Binding, kind: str, observed: Observed,
                    conds: list[dict[str, Any]]) -> dict[str, Any]:
    def is_true(type_: str) -> bool:
        cond = conditions.find(conds, type_)
        return cond is not None and cond["status"] == "True"

    if is_true("Degraded"):
        phase = "Degraded"
    elif is_true("Ready"):
        phase = "Ready"
    elif observed.replicas > 0:
        phase = "Progressing"
    else:
        phase = "Pending"
    status: dict[str, Any] = {
        "phase": phase,
        "replicas": observed.replicas,
        "readyReplicas": observed.ready_replicas,
        "selector": names.selector_string(names.server_selector(session.name)),
        "url": builders.service_url(session),
        "workload": f"{kind}/{names.workload(session.name)}",
        "tensorParallelSize": max(1, session.resources.gpus),
        # null removes it (status is merge-patched) when the router is switched off
        "router": builders.routing(session).as_status() if session.router.enabled else None,
        "cacheTier": binding.tier.name if binding.tier else (session.cache_tier or ""),
        "metricsSource": observed.source,
        "lastScrapeTime": conditions.now(),
        "conditions": conds,
    }
    if session.generation is not None:
        status["observedGeneration"] = session.generation
    if observed.cache_hit_rate is not None:
        status["cacheHitRate"] = observed.cache_hit_rate
    if observed.open_sessions is not None:
        status["openSessions"] = observed.open_sessions
    return status


async def finalize_session(kube: Kube, body: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Delete everything the session owns (owner references let a real cluster do it too,
    but deleting here makes teardown immediate and independent of the garbage collector)."""
    session = parse_session(body)
    deleted = await kube.prune(SESSION_CHILD_KINDS, session.namespace, {names.SESSION_LABEL: session.name},
                               session.uid, keep=())
    if session.cache_tier:
        await sync_tier_bindings(kube, session.namespace, session.cache_tier, leaving=session.name)
    return deleted


async def sessions_using(kube: Kube, namespace: str, tier_name: str, leaving: str | None = None) -> list[str]:
    items = await kube.list("InferenceSession", namespace)
    return sorted(
        item["metadata"]["name"] for item in items
        if ((item.get("spec") or {}).get("cacheTierRef") or {}).get("name") == tier_name
        and item["metadata"]["name"] != leaving
        and not item["metadata"].get("deletionTimestamp")
    )


async def sync_tier_bindings(kube: Kube, namespace: str, tier_name: str, leaving: str | None = None) -> None:
    """Refresh a tier's boundSessions right away rather than at its next status tick (when they changed)."""
    tier = await kube.get("CacheTier", namespace, tier_name)
    if tier is None:
        return
    bound = await sessions_using(kube, namespace, tier_name, leaving)
    if (tier.get("status") or {}).get("boundSessions") == bound:
        return
    try:
        await kube.patch_status("CacheTier", namespace, tier_name,
                                {"boundSessions": bound, "boundSessionCount": len(bound)})
    except ApiError as e:
        if e.status != 404:  # deleted since the read above: nothing left to refresh
            raise


async def reconcile_tier(kube: Kube, body: Mapping[str, Any], metrics_timeout: float = 2.0) -> Outcome:
    """The claim, then status. Ready means: the storage is real (the shared claim is Bound, or
    each pod gets its own claim) and no server pod using the tier reports its storage tier off.
    Occupancy is what those pods' /metrics report; a tier without sessions has none to show."""
    tier = parse_cache_tier(body)
    previous = (body.get("status") or {}).get("conditions") or []
    events: list[Event] = []
    problems: list[Problem] = []
    storage: Condition
    claim = builders.build_tier_claim(tier)
    if claim is not None and not tier.terminating:
        try:
            applied = await kube.apply(claim)
            if applied.action == "created":
                events.append(Event("Normal", "Created", f"created PersistentVolumeClaim {claim['metadata']['name']}"))
        except ApiError as e:
            if not e.invalid:
                raise
            problems.append(Problem("InvalidClaim", f"claim {claim['metadata']['name']}: {e.message}"))
    if not tier.storage.enabled:
        storage = Condition("StorageBound", "False", "Disabled", "no storage tier")
    elif tier.storage.per_pod:
        storage = Condition("StorageBound", "True", "PerPodClaims",
                            "each server pod gets its own claim from the StatefulSet's volume claim template")
    else:
        live = await kube.get("PersistentVolumeClaim", tier.namespace, tier.claim_name or "")
        phase = ((live or {}).get("status") or {}).get("phase")
        if live is None:
            storage = Condition("StorageBound", "False", "ClaimMissing", f"claim {tier.claim_name} does not exist")
        elif phase == "Bound":
            storage = Condition("StorageBound", "True", "ClaimBound", f"claim {tier.claim_name} is bound")
        else:
            storage = Condition("StorageBound", "False", "ClaimPending",
                                f"claim {tier.claim_name} is {phase or 'not bound yet'}")

    bound = await sessions_using(kube, tier.namespace, tier.name)
    in_use = Condition("InUse", "True" if bound else "False", "BoundSessions" if bound else "Unused",
                       ", ".join(bound))
    if tier.terminating and bound:
        in_use = Condition("InUse", "True", "DeletionBlocked",
                           f"deletion waits until no InferenceSession references this tier: {', '.join(bound)}")
    pods = [p for name in bound for p in await kube.list("Pod", tier.namespace, names.server_selector(name))]
    occupancy = tier_occupancy(await scrape(pods, metrics_timeout), shared_storage=not tier.storage.per_pod)
    if occupancy.storage_off:
        problems.append(Problem("StorageUnavailable",
                                f"server pods {', '.join(occupancy.storage_off)} switched the storage tier off "
                                "(its directory is full, read-only or gone); they serve from GPU and host only"))
    degraded = _degraded(problems)
    storage_ok = storage.status == "True" or storage.reason == "Disabled"
    if degraded.status == "True":
        ready = Condition("Ready", "False", degraded.reason, degraded.message)
    elif not storage_ok:
        ready = Condition("Ready", "False", storage.reason, storage.message)
    else:
        ready = Condition("Ready", "True", "Ready", _occupancy_message(occupancy))
    merged = conditions.merge(previous, [ready, degraded, storage, in_use], tier.generation)
    phase = "Terminating" if tier.terminating else ("Degraded" if degraded.status == "True"
                                                    else "Ready" if ready.status == "True" else "Pending")
    status: dict[str, Any] = {
        "phase": phase,
        "claimName": tier.claim_name or "",
        "boundSessions": bound,
        "boundSessionCount": len(bound),
        "occupancy": occupancy.as_status(),
        "conditions": merged,
    }
    if tier.generation is not None:
        status["observedGeneration"] = tier.generation
    return Outcome(status, events + conditions.transitions(previous, merged))


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def _occupancy_message(o: TierOccupancy) -> str:
    if not o.pods:
        return "no server pod reports occupancy yet"
    parts = []
    for tier, used, cap in (("host", o.host_used, o.host_capacity), ("storage", o.storage_used, o.storage_capacity)):
        if used is not None and cap:
            parts.append(f"{tier} {_gib(used)} of {_gib(cap)} used")
    return f"{', '.join(parts) or 'no tier below the GPU reported'} ({o.pods} pods reporting)"


async def finalize_tier(kube: Kube, body: Mapping[str, Any]) -> list[str]:
    """Sessions that still reference the tier (deletion must wait), or [] after cleaning up."""
    tier = parse_cache_tier(body)
    bound = await sessions_using(kube, tier.namespace, tier.name)
    if bound:
        return bound
    if tier.storage.shared_claim_created:
        claim = await kube.get("PersistentVolumeClaim", tier.namespace, names.tier_claim(tier.name))
        if claim is not None and owned_by(claim, tier.uid):
            await kube.delete("PersistentVolumeClaim", tier.namespace, names.tier_claim(tier.name))
    return []


async def sessions_for_tier(kube: Kube, namespace: str, tier_name: str) -> list[dict[str, Any]]:
    items = await kube.list("InferenceSession", namespace)
    return [i for i in items if ((i.get("spec") or {}).get("cacheTierRef") or {}).get("name") == tier_name
            and not i["metadata"].get("deletionTimestamp")]
