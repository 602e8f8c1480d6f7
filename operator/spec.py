"""Typed views of InferenceSession and CacheTier objects, with the CRD defaults applied.

The API server applies the CRD defaults before the operator ever sees an object, but the defaults
are repeated here so that the builders never meet a missing field (objects written before a
default was added, or API emulators that do not default). A test keeps both sets of defaults equal.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_SUFFIX = {
    None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
}


def quantity_bytes(value: str | int | float) -> float:
    """A Kubernetes quantity (the subset the CRDs accept) as a plain number."""
    if isinstance(value, (int, float)):
        return float(value)
    match = _QUANTITY.match(value.strip())
    if match is None:
        raise ValueError(f"not a quantity: {value!r}")
    return float(match.group(1)) * _SUFFIX[match.group(2)]


def _get(mapping: Mapping[str, Any] | None, key: str, default: Any = None) -> Any:
    if not mapping:
        return default
    value = mapping.get(key)
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class ModelCache:
    """A claim the session's hf:// model is downloaded into once and that every pod mounts read-only."""
    enabled: bool = False
    size: str | None = None
    storage_class_name: str | None = None
    access_mode: str = "ReadWriteMany"


@dataclasses.dataclass(frozen=True)
class ModelDownload:
    allow_patterns: tuple[str, ...] = ()  # empty: the server's own list (mambaserve.server.model.download)
    requests: Mapping[str, str | int] = dataclasses.field(default_factory=dict)
    limits: Mapping[str, str | int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    source: str
    served_name: str | None = None
    token_secret: str | None = None
    token_key: str = "token"
    download_size_limit: str = "64Gi"
    checkpoint_size: str | None = None  # the weight files' size: read into host memory while loading
    cache: ModelCache = ModelCache()
    download: ModelDownload = ModelDownload()

    @property
    def scheme(self) -> str:
        if self.source.startswith("hf://"):
            return "hf"
        if self.source.startswith("pvc://"):
            return "pvc"
        return "image"

    @property
    def hf_repo(self) -> str:
        return self.source[len("hf://"):].split("@", 1)[0]

    @property
    def hf_revision(self) -> str:
        rest = self.source[len("hf://"):]
        return rest.split("@", 1)[1] if "@" in rest else "main"

    @property
    def pvc_claim(self) -> str:
        return self.source[len("pvc://"):].split("/", 1)[0]

    @property
    def pvc_path(self) -> str:
        rest = self.source[len("pvc://"):]
        return rest.split("/", 1)[1].strip("/") if "/" in rest else ""


@dataclasses.dataclass(frozen=True)
class Resources:
    gpus: int = 1
    gpu_resource_name: str = "nvidia.com/gpu"
    requests: Mapping[str, str | int] = dataclasses.field(default_factory=dict)
    limits: Mapping[str, str | int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    max_running_requests: int | None = None
    chunked_prefill_size: int = 2048
    context_length: int | None = None
    page_size: int | None = None  # None: the server's default (it depends on the model's architecture)
    cache_strategy: str = "no_buffer"
    track_interval: int | None = None
    dtype: str = "auto"
    state_dtype: str = "float32"
    disable_radix_cache: bool = False
    log_level: str = "info"
    stuck_step_timeout_seconds: int = 300  # the liveness probe's /health?stuck_step_timeout=
    api_key_secret: str | None = None  # Secret name; its `api_key_key` entry becomes MAMBASERVE_API_KEY
    api_key_key: str = "api-key"
    extra_args: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class SessionPolicy:
    streaming: bool = True
    timeout_seconds: int = 600
    max_sessions: int = 1024
    persist: bool = False
    drain_seconds: int = 30


@dataclasses.dataclass(frozen=True)
class ScalingBehaviour:
    stabilization_window_seconds: int
    pods: int
    period_seconds: int


@dataclasses.dataclass(frozen=True)
class Autoscaling:
    enabled: bool = False
    engine: str = "hpa"
    min_replicas: int = 1
    max_replicas: int = 4
    target_capacity_miss_ratio: float = 0.1
    target_queue_depth: int | None = None
    scale_up: ScalingBehaviour = ScalingBehaviour(0, 2, 60)
    scale_down: ScalingBehaviour = ScalingBehaviour(600, 1, 300)
    prometheus_address: str | None = None
    polling_interval_seconds: int = 30


@dataclasses.dataclass(frozen=True)
class Router:
    enabled: bool = False
    policy: str = "auto"  # builders/router.py: routing
    replicas: int = 1
    image: str | None = None


@dataclasses.dataclass(frozen=True)
class Monitoring:
    enabled: bool = True
    interval: str = "30s"


@dataclasses.dataclass(frozen=True)
class KernelCache:
    """Triton's compile cache on a claim (the server's --kernel-cache-dir)."""
    enabled: bool = False
    size: str | None = None
    storage_class_name: str | None = None
    access_mode: str = "ReadWriteMany"
    existing_claim: str | None = None


@dataclasses.dataclass(frozen=True)
class Rollout:
    strategy: str | None = None  # Surge | Replace; None: from spare_gpus
    spare_gpus: int = 0


@dataclasses.dataclass(frozen=True)
class Placement:
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str | None = None
    runtime_class_name: str | None = None
    # None: the operator's spread (over nodes and zones); an empty tuple: no spread at all.
    topology_spread_constraints: tuple[Mapping[str, Any], ...] | None = None


@dataclasses.dataclass(frozen=True)
class InferenceSession:
    name: str
    namespace: str
    uid: str
    generation: int | None
    model: ModelSource
    replicas: int = 1
    image: str | None = None
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    resources: Resources = Resources()
    server: ServerSettings = ServerSettings()
    sessions: SessionPolicy = SessionPolicy()
    cache_tier: str | None = None
    autoscaling: Autoscaling = Autoscaling()
    router: Router = Router()
    monitoring: Monitoring = Monitoring()
    termination_grace_period_seconds: int = 60
    rollout: Rollout = Rollout()
    kernel_cache: KernelCache = KernelCache()
    placement: Placement = Placement()
    # Merged over the server pod template last (builders/overrides.py); None: nothing to merge.
    pod_template: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class StorageTier:
    enabled: bool = False
    size: str | None = None
    storage_class_name: str | None = None
    access_mode: str = "ReadWriteOnce"
    existing_claim: str | None = None
    path: str = "/var/cache/mambaserve"

    @property
    def per_pod(self) -> bool:
        """Each pod needs its own claim: a single-writer volume the operator creates."""
        return self.enabled and self.existing_claim is None and self.access_mode != "ReadWriteMany"

    @property
    def shared_claim_created(self) -> bool:
        return self.enabled and self.existing_claim is None and self.access_mode == "ReadWriteMany"


@dataclasses.dataclass(frozen=True)
class Compatibility:
    model_source: str | None = None
    state_dtype: str | None = None
    page_size: int | None = None


@dataclasses.dataclass(frozen=True)
class CacheTier:
    name: str
    namespace: str
    uid: str
    generation: int | None
    gpu_state_slots: int | None = None
    gpu_memory_fraction: float | None = None
    host_size_gb: float = 0.0
    storage: StorageTier = StorageTier()
    write_policy: str = "write_back"
    prefetch_policy: str = "best_effort"
    compatibility: Compatibility = Compatibility()
    terminating: bool = False

    @property
    def claim_name(self) -> str | None:
        """The claim every pod mounts, or None when there is none or each pod has its own."""
        if not self.storage.enabled:
            return None
        if self.storage.existing_claim:
            return self.storage.existing_claim
        if self.storage.shared_claim_created:
            return f"{self.name}-storage"
        return None


def _meta(body: Mapping[str, Any]) -> tuple[str, str, str, int | None]:
    meta = body.get("metadata") or {}
    return meta.get("name", ""), meta.get("namespace", ""), meta.get("uid", ""), meta.get("generation")


def _behaviour(raw: Mapping[str, Any] | None, default: ScalingBehaviour) -> ScalingBehaviour:
    return ScalingBehaviour(
        stabilization_window_seconds=int(_get(raw, "stabilizationWindowSeconds", default.stabilization_window_seconds)),
        pods=int(_get(raw, "pods", default.pods)),
        period_seconds=int(_get(raw, "periodSeconds", default.period_seconds)),
    )


def parse_session(body: Mapping[str, Any]) -> InferenceSession:
    name, namespace, uid, generation = _meta(body)
    spec = body.get("spec") or {}
    model = spec.get("model") or {}
    token = model.get("tokenSecretRef") or {}
    resources = spec.get("resources") or {}
    server = spec.get("server") or {}
    sessions = spec.get("sessions") or {}
    scaling = spec.get("autoscaling") or {}
    router = spec.get("router") or {}
    monitoring = spec.get("monitoring") or {}
    placement = spec.get("placement") or {}
    d_as, d_srv, d_sess = Autoscaling(), ServerSettings(), SessionPolicy()
    return InferenceSession(
        name=name, namespace=namespace, uid=uid, generation=generation,
        model=ModelSource(
            source=str(model.get("source", "")),
            served_name=model.get("servedName") or None,
            token_secret=token.get("name"),
            token_key=_get(token, "key", "token"),
            download_size_limit=_get(model, "downloadSizeLimit", "64Gi"),
            checkpoint_size=model.get("checkpointSize") or None,
            cache=ModelCache(
                enabled=bool(_get(model.get("cache"), "enabled", False)),
                size=(model.get("cache") or {}).get("size"),
                storage_class_name=(model.get("cache") or {}).get("storageClassName"),
                access_mode=_get(model.get("cache"), "accessMode", "ReadWriteMany"),
            ),
            download=ModelDownload(
                allow_patterns=tuple((model.get("download") or {}).get("allowPatterns") or ()),
                requests=dict(((model.get("download") or {}).get("resources") or {}).get("requests") or {}),
                limits=dict(((model.get("download") or {}).get("resources") or {}).get("limits") or {}),
            ),
        ),
        replicas=int(_get(spec, "replicas", 1)),
        image=spec.get("image") or None,
        image_pull_policy=_get(spec, "imagePullPolicy", "IfNotPresent"),
        image_pull_secrets=tuple(s["name"] for s in spec.get("imagePullSecrets") or () if s.get("name")),
        resources=Resources(
            gpus=int(_get(resources, "gpus", 1)),
            gpu_resource_name=_get(resources, "gpuResourceName", "nvidia.com/gpu"),
            requests=dict(resources.get("requests") or {}),
            limits=dict(resources.get("limits") or {}),
        ),
        server=ServerSettings(
            max_running_requests=server.get("maxRunningRequests"),
            chunked_prefill_size=int(_get(server, "chunkedPrefillSize", d_srv.chunked_prefill_size)),
            context_length=server.get("contextLength"),
            page_size=server.get("pageSize"),
            cache_strategy=_get(server, "cacheStrategy", d_srv.cache_strategy),
            track_interval=server.get("trackInterval"),
            dtype=_get(server, "dtype", d_srv.dtype),
            state_dtype=_get(server, "stateDtype", d_srv.state_dtype),
            disable_radix_cache=bool(_get(server, "disableRadixCache", False)),
            log_level=_get(server, "logLevel", d_srv.log_level),
            stuck_step_timeout_seconds=int(_get(server, "stuckStepTimeoutSeconds", d_srv.stuck_step_timeout_seconds)),
            api_key_secret=(server.get("apiKeySecret") or {}).get("name") or None,
            api_key_key=_get(server.get("apiKeySecret"), "key", d_srv.api_key_key),
            extra_args=tuple(server.get("extraArgs") or ()),
        ),
        sessions=SessionPolicy(
            streaming=bool(_get(sessions, "streaming", d_sess.streaming)),
            timeout_seconds=int(_get(sessions, "timeoutSeconds", d_sess.timeout_seconds)),
            max_sessions=int(_get(sessions, "maxSessions", d_sess.max_sessions)),
            persist=bool(_get(sessions, "persist", d_sess.persist)),
            drain_seconds=int(_get(sessions, "drainSeconds", d_sess.drain_seconds)),
        ),
        cache_tier=(spec.get("cacheTierRef") or {}).get("name") or None,
        autoscaling=Autoscaling(
            enabled=bool(_get(scaling, "enabled", d_as.enabled)),
            engine=_get(scaling, "engine", d_as.engine),
            min_replicas=int(_get(scaling, "minReplicas", d_as.min_replicas)),
            max_replicas=int(_get(scaling, "maxReplicas", d_as.max_replicas)),
            target_capacity_miss_ratio=float(_get(scaling, "targetCapacityMissRatio",
                                                  d_as.target_capacity_miss_ratio)),
            target_queue_depth=scaling.get("targetQueueDepth"),
            scale_up=_behaviour(scaling.get("scaleUp"), d_as.scale_up),
            scale_down=_behaviour(scaling.get("scaleDown"), d_as.scale_down),
            prometheus_address=scaling.get("prometheusAddress") or None,
            polling_interval_seconds=int(_get(scaling, "pollingIntervalSeconds", d_as.polling_interval_seconds)),
        ),
        router=Router(
            enabled=bool(_get(router, "enabled", False)),
            policy=_get(router, "policy", "auto"),
            replicas=int(_get(router, "replicas", 1)),
            image=router.get("image") or None,
        ),
        monitoring=Monitoring(
            enabled=bool(_get(monitoring, "enabled", True)),
            interval=_get(monitoring, "interval", "30s"),
        ),
        termination_grace_period_seconds=int(_get(spec, "terminationGracePeriodSeconds", 60)),
        kernel_cache=KernelCache(
            enabled=bool(_get(spec.get("kernelCache"), "enabled", False)),
            size=(spec.get("kernelCache") or {}).get("size"),
            storage_class_name=(spec.get("kernelCache") or {}).get("storageClassName"),
            access_mode=_get(spec.get("kernelCache"), "accessMode", "ReadWriteMany"),
            existing_claim=(spec.get("kernelCache") or {}).get("existingClaim") or None,
        ),
        rollout=Rollout(strategy=(spec.get("rollout") or {}).get("strategy") or None,
                        spare_gpus=int(_get(spec.get("rollout"), "spareGpus", 0))),
        placement=Placement(
            node_selector=dict(placement.get("nodeSelector") or {}),
            tolerations=tuple(placement.get("tolerations") or ()),
            affinity=placement.get("affinity") or None,
            priority_class_name=placement.get("priorityClassName") or None,
            runtime_class_name=placement.get("runtimeClassName") or None,
            topology_spread_constraints=None if placement.get("topologySpreadConstraints") is None
            else tuple(placement["topologySpreadConstraints"]),
        ),
        pod_template=spec.get("podTemplate") or None,
    )


def parse_cache_tier(body: Mapping[str, Any]) -> CacheTier:
    name, namespace, uid, generation = _meta(body)
    spec = body.get("spec") or {}
    gpu = spec.get("gpu") or {}
    host = spec.get("host") or {}
    storage = spec.get("storage") or {}
    compat = spec.get("compatibility") or {}
    return CacheTier(
        name=name, namespace=namespace, uid=uid, generation=generation,
        gpu_state_slots=gpu.get("stateSlots"),
        gpu_memory_fraction=gpu.get("memoryFraction"),
        host_size_gb=float(_get(host, "sizeGb", 0.0)),
        storage=StorageTier(
            enabled=bool(_get(storage, "enabled", False)),
            size=storage.get("size"),
            storage_class_name=storage.get("storageClassName"),
            access_mode=_get(storage, "accessMode", "ReadWriteOnce"),
            existing_claim=storage.get("existingClaim") or None,
            path=_get(storage, "path", "/var/cache/mambaserve"),
        ),
        write_policy=_get(spec, "writePolicy", "write_back"),
        prefetch_policy=_get(spec, "prefetchPolicy", "best_effort"),
        compatibility=Compatibility(
            model_source=compat.get("modelSource"),
            state_dtype=compat.get("stateDtype"),
            page_size=compat.get("pageSize"),
        ),
        terminating=bool((body.get("metadata") or {}).get("deletionTimestamp")),
    )


@dataclasses.dataclass(frozen=True)
class Problem:
    """Something the schema cannot reject but the operator cannot honour fully."""
    reason: str
    message: str


def incompatibilities(session: InferenceSession, tier: CacheTier) -> list[Problem]:
    """Why the session must not use the states stored in this tier (empty: compatible)."""
    pin, problems = tier.compatibility, []
    if pin.model_source and pin.model_source != session.model.source:
        problems.append(Problem("Incompatible", f"CacheTier {tier.name} holds states of model {pin.model_source!r}, "
                                                f"not {session.model.source!r}"))
    if pin.state_dtype and pin.state_dtype != session.server.state_dtype:
        problems.append(Problem("Incompatible", f"CacheTier {tier.name} holds {pin.state_dtype} states, "
                                                f"the session uses stateDtype {session.server.state_dtype}"))
    # an unset page size is the server's default for the model: the server's own compatibility key decides
    if pin.page_size and session.server.page_size and pin.page_size != session.server.page_size:
        problems.append(Problem("Incompatible", f"CacheTier {tier.name} is pinned to pageSize {pin.page_size}, "
                                                f"the session uses {session.server.page_size}"))
    return problems


def session_problems(session: InferenceSession, tier: CacheTier | None) -> list[Problem]:
    """Cross-object problems: the session runs, but not as asked. Reported as Degraded."""
    problems = []
    if session.sessions.persist and (tier is None or not tier.storage.enabled):
        problems.append(Problem("PersistenceNeedsStorage",
                                "sessions.persist needs a cacheTierRef whose CacheTier has storage enabled; "
                                "sessions will not survive restarts"))
    cache = session.model.cache
    if session.model.scheme == "hf" and cache.enabled and cache.access_mode == "ReadWriteOnce":
        most = session.autoscaling.max_replicas if session.autoscaling.enabled else session.replicas
        if most > 1:
            problems.append(Problem("ModelCacheSingleNode",
                                    f"model.cache is ReadWriteOnce but up to {most} pods mount it: pods on other "
                                    "nodes than the download Job's cannot start (use ReadWriteMany)"))
    kernels = session.kernel_cache
    if kernels.enabled and kernels.access_mode == "ReadWriteOnce":
        most = session.autoscaling.max_replicas if session.autoscaling.enabled else session.replicas
        if most > 1:
            problems.append(Problem("KernelCacheSingleNode",
                                    f"kernelCache is ReadWriteOnce but up to {most} pods mount it: pods on other "
                                    "nodes than the first cannot start (use ReadWriteMany)"))
    if tier is not None and tier.storage.enabled and tier.storage.existing_claim \
            and tier.storage.access_mode != "ReadWriteMany":
        most = session.autoscaling.max_replicas if session.autoscaling.enabled else session.replicas
        if most > 1:
            problems.append(Problem("SharedSingleWriterClaim",
                                    f"existing claim {tier.storage.existing_claim} is {tier.storage.access_mode} "
                                    f"but up to {most} pods would mount it; only one node can"))
    return problems
