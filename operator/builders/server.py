"""The server workload: flags, pod template, and a Deployment or a StatefulSet.

A StatefulSet is used only when each pod needs its own storage-tier claim (a single-writer access
mode that the operator provisions); everything else runs as a Deployment.
"""

from __future__ import annotations

from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders import model, pod
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.builders.overrides import apply_pod_template
from mambaserve.operator.builders.resources import Footprint, container_resources, footprint
from mambaserve.operator.settings import GROUP, SERVER_PORT, OperatorSettings
from mambaserve.operator.spec import CacheTier, InferenceSession, Problem, quantity_bytes, session_problems

CACHE_VOLUME = "cache"
# Triton's compile cache on the kernel-cache claim (spec.kernelCache).
KERNELS_DIR = "/var/lib/mambaserve/kernels"
HOME_DIR = "/var/lib/mambaserve/home"
# Session snapshots go to the storage tier when the CacheTier has one, else to an emptyDir here.
SESSIONS_DIR = "/var/lib/mambaserve/sessions"
# Writable directories under the read-only root filesystem (name, path, size limit). HOME holds
# what libraries cache there (Triton's compiled kernels, the CUDA JIT cache, Hugging Face files).
SCRATCH = (("tmp", pod.TMP_DIR, "1Gi"), ("home", HOME_DIR, "4Gi"))
# Session snapshots without a storage tier: lost with the pod, but written somewhere writable.
SESSIONS_SIZE = "16Gi"
# /dev/shm defaults to 64 MiB in a container; PyTorch's pinned host buffers and IPC need more. Memory-backed,
# so it counts in the pod's memory footprint.
SHM_SIZE = "2Gi"
# An annotation of the workload (not of its pods: it changes only with the resources) with the arithmetic.
MEMORY_ANNOTATION = f"{GROUP}/memory"
# Directories on a storage tier's volume: the server's L3 entries, and session snapshot files
# (both shared by every pod that mounts a ReadWriteMany claim).
STATES_SUBDIR = "states"
SNAPSHOTS_SUBDIR = "sessions"
SPREAD_KEYS = ("kubernetes.io/hostname", "topology.kubernetes.io/zone")
# Of the seconds a pod has after SIGTERM (terminationGracePeriodSeconds), those the server's drain leaves for its
# exit: the engine's stop, whose queued storage writes reach the disk.
DRAIN_MARGIN_S = 5


def model_path(session: InferenceSession) -> str:
    return model.model_dir(session)


def server_args(session: InferenceSession, tier: CacheTier | None) -> list[str]:
    """The server's command line, flag names exactly as in docs/server-interface.md."""
    srv, sess = session.server, session.sessions
    args = [
        "--model", model_path(session),
        "--host", "0.0.0.0",
        "--port", str(SERVER_PORT),
        "--device", "cuda" if session.resources.gpus > 0 else "cpu",
        "--dtype", srv.dtype,
        "--state-dtype", srv.state_dtype,
        "--chunked-prefill-size", str(srv.chunked_prefill_size),
        "--mamba-cache-strategy", srv.cache_strategy,
        "--max-sessions", str(sess.max_sessions),
        "--session-timeout", str(sess.timeout_seconds),
        "--drain-timeout", str(drain_timeout(session)),
        "--log-level", srv.log_level,
    ]
    if session.resources.gpus > 1:  # one process per GPU of the pod, the model sharded over them
        args += ["--tensor-parallel-size", str(session.resources.gpus)]
    if session.model.served_name:
        args += ["--served-model-name", session.model.served_name]
    if srv.max_running_requests is not None:
        args += ["--max-running-requests", str(srv.max_running_requests)]
    if srv.context_length is not None:
        args += ["--context-length", str(srv.context_length)]
    if srv.page_size is not None:
        args += ["--page-size", str(srv.page_size)]
    if srv.track_interval:
        args += ["--mamba-track-interval", str(srv.track_interval)]
    if srv.disable_radix_cache:
        args += ["--disable-radix-cache"]
    if tier is not None and tier.gpu_state_slots is not None:
        args += ["--mamba-cache-size", str(tier.gpu_state_slots)]
    if tier is not None and tier.gpu_memory_fraction is not None:
        args += ["--mem-fraction-static", f"{tier.gpu_memory_fraction:g}"]
    if tier is not None and tier.host_size_gb > 0:
        args += ["--host-cache-size", f"{tier.host_size_gb:g}GiB"]
    args += storage_args(session, tier)
    if session.kernel_cache.enabled:
        args += ["--kernel-cache-dir", KERNELS_DIR]
    return args + list(srv.extra_args)


# Shares of a storage-tier claim: cached states (LRU-deleted by the server past their share) and
# session snapshots (refused past theirs). The rest is headroom for filesystem metadata and the
# temporary files of atomic writes, so the volume itself never fills up.
STATES_SHARE = 0.85
SNAPSHOTS_SHARE = 0.10


def drain_timeout(session: InferenceSession) -> int:
    """The server's --drain-timeout: on SIGTERM it finishes what is in flight and writes its sessions within
    terminationGracePeriodSeconds less the exit's margin. The pod's grace period is that plus the preStop hook's
    drainSeconds (``pod_template``), so the kubelet's SIGKILL never comes before the drain's deadline."""
    return max(0, session.termination_grace_period_seconds - DRAIN_MARGIN_S)


def storage_args(session: InferenceSession, tier: CacheTier | None) -> list[str]:
    """Flags of the tiers below the GPU (docs/server-interface.md), and where session snapshots go."""
    if tier is None or not tier.storage.enabled:
        args = []
        if tier is not None and tier.host_size_gb > 0:
            args += ["--cache-write-policy", tier.write_policy]
        # Always named: the server's default is relative to its working directory, on a read-only filesystem.
        return args + ["--session-snapshot-dir", SESSIONS_DIR]
    root = tier.storage.path.rstrip("/")
    args = ["--storage-dir", f"{root}/{STATES_SUBDIR}"]
    if tier.storage.size:
        # An existing claim's size is not known here: the server then sizes the tier itself.
        size = quantity_bytes(tier.storage.size)
        args += ["--storage-size", str(int(size * STATES_SHARE))]
    args += ["--cache-write-policy", tier.write_policy, "--cache-prefetch-policy", tier.prefetch_policy,
             "--session-snapshot-dir", f"{root}/{SNAPSHOTS_SUBDIR}"]
    if tier.storage.size:
        args += ["--session-snapshot-max-bytes", str(int(quantity_bytes(tier.storage.size) * SNAPSHOTS_SHARE))]
    if session.sessions.persist:
        args += ["--session-persist"]
    return args


def _probe(path: str, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def runtime_env() -> list[dict[str, Any]]:
    """Where the server's libraries write, all inside the scratch volumes."""
    return [
        {"name": "HOME", "value": HOME_DIR},
        {"name": "TMPDIR", "value": pod.TMP_DIR},
        {"name": "TRITON_CACHE_DIR", "value": f"{HOME_DIR}/.triton/cache"},
        {"name": "HF_HOME", "value": f"{HOME_DIR}/.cache/huggingface"},
        # The root filesystem is read-only: no bytecode files.
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]


def _scratch() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return ([pod.empty_dir(name, size) for name, _, size in SCRATCH],
            [pod.mount(name, path) for name, path, _ in SCRATCH])


def _placement(session: InferenceSession) -> dict[str, Any]:
    placement, spec = session.placement, {}
    if placement.node_selector:
        spec["nodeSelector"] = dict(placement.node_selector)
    tolerations = [dict(t) for t in placement.tolerations]
    if session.resources.gpus > 0:
        tolerations = pod.gpu_tolerations(session.resources.gpu_resource_name, tolerations)
    if tolerations:
        spec["tolerations"] = tolerations
    if placement.affinity:
        spec["affinity"] = dict(placement.affinity)
    spread = placement.topology_spread_constraints
    spread = pod.topology_spread(names.server_selector(session.name), SPREAD_KEYS) if spread is None \
        else [dict(c) for c in spread]
    if spread:
        spec["topologySpreadConstraints"] = spread
    if placement.priority_class_name:
        spec["priorityClassName"] = placement.priority_class_name
    if placement.runtime_class_name:
        spec["runtimeClassName"] = placement.runtime_class_name
    return spec


def memory_footprint(session: InferenceSession, tier: CacheTier | None) -> Footprint:
    return footprint(session, tier, shm_bytes=int(quantity_bytes(SHM_SIZE)))


def problems(session: InferenceSession, tier: CacheTier | None) -> list[Problem]:
    """The spec's cross-object problems, and a memory request or limit below what the pod holds."""
    found = session_problems(session, tier)
    if session.rollout.strategy == "Surge" and tier is not None and tier.storage.per_pod:
        found.append(Problem("SurgeNotPossible", "rollout.strategy Surge: a StatefulSet (the CacheTier gives each "
                                                 "pod its own claim) replaces its pods one at a time"))
    need = memory_footprint(session, tier)
    for kind, given in (("requests", session.resources.requests), ("limits", session.resources.limits)):
        if "memory" in given and quantity_bytes(given["memory"]) < need.total:
            found.append(Problem("MemoryBelowFootprint",
                                 f"resources.{kind}.memory {given['memory']} is below what a server pod holds: "
                                 f"{need.describe()}; the pod may be OOM-killed"))
    return found


def pod_template(session: InferenceSession, tier: CacheTier | None, settings: OperatorSettings) -> dict[str, Any]:
    image = session.image or settings.server_image
    volumes, mounts, init = model.model_volumes(session, image)
    scratch_volumes, scratch_mounts = _scratch()
    volumes += scratch_volumes
    mounts += scratch_mounts
    volumes.append(pod.empty_dir("dshm", SHM_SIZE, medium="Memory"))
    mounts.append(pod.mount("dshm", "/dev/shm"))
    kernels = session.kernel_cache
    if kernels.enabled:
        claim = kernels.existing_claim or names.kernel_claim(session.name)
        volumes.append({"name": "kernels", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append(pod.mount("kernels", KERNELS_DIR))
    if tier is not None and tier.storage.enabled:
        if not tier.storage.per_pod:
            volumes.append({"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": tier.claim_name}})
        mounts.append(pod.mount(CACHE_VOLUME, tier.storage.path))
    else:
        volumes.append(pod.empty_dir("sessions", SESSIONS_SIZE))
        mounts.append(pod.mount("sessions", SESSIONS_DIR))

    # Streaming sessions hold live state: keep routing away from a stopping pod for drainSeconds
    # (endpoints and the router see it NotReady) before the server gets SIGTERM; then the server drains itself
    # (--drain-timeout), within the rest of the grace period.
    drain = session.sessions.drain_seconds if session.sessions.streaming else 0
    container: dict[str, Any] = {
        "name": "server",
        "image": image,
        "imagePullPolicy": session.image_pull_policy,
        "command": ["mambaserve", "serve"],
        "args": server_args(session, tier),
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            *runtime_env(),
            *([{"name": "MAMBASERVE_API_KEY", "valueFrom": {"secretKeyRef": {
                "name": session.server.api_key_secret, "key": session.server.api_key_key}}}]
              if session.server.api_key_secret else []),
        ],
        "resources": container_resources(session, memory_footprint(session, tier)),
        "volumeMounts": mounts,
        # Loading weights can take minutes; the startup probe holds liveness off until /health is 200.
        "startupProbe": _probe("/health", period=10, failures=90),
        "readinessProbe": _probe("/health", period=5, failures=3),
        # Liveness from progress: fails while one step has run past the timeout with requests pending.
        "livenessProbe": _probe(f"/health?stuck_step_timeout={session.server.stuck_step_timeout_seconds}",
                                period=15, failures=4),
        "securityContext": pod.container_security_context(),
    }
    if drain > 0:
        container["lifecycle"] = pod.drain_hook(drain)

    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": session.termination_grace_period_seconds + drain,
        "enableServiceLinks": False,
        # The server never calls the Kubernetes API: no token in its filesystem.
        "automountServiceAccountToken": False,
        "securityContext": pod.pod_security_context(),
        **_placement(session),
    }
    if init:
        spec["initContainers"] = init
    if session.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in session.image_pull_secrets]
    labels = names.session_labels(session.name, "server")
    rendered = {"metadata": {"labels": labels}, "spec": spec}
    return apply_pod_template(rendered, session.pod_template, labels)


def rollout(session: InferenceSession) -> tuple[str, int]:
    """(strategy, pods started ahead of the old ones): Surge needs free GPUs for its extra pods, so without
    spareGpus declared a GPU session replaces (the new pod would wait Pending for a GPU the old one holds)."""
    gpus = session.resources.gpus
    ahead = session.rollout.spare_gpus // gpus if gpus else 1
    strategy = session.rollout.strategy or ("Surge" if ahead >= 1 else "Replace")
    return strategy, max(1, ahead) if strategy == "Surge" else 0


def deployment_strategy(session: InferenceSession) -> dict[str, Any]:
    strategy, ahead = rollout(session)
    if strategy == "Surge":  # never a serving pod down before its replacement is ready
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": ahead, "maxUnavailable": 0}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def build_workload(session: InferenceSession, tier: CacheTier | None, settings: OperatorSettings,
                   replicas: int | None) -> dict[str, Any]:
    """Deployment, or StatefulSet when the cache tier gives each pod its own claim.

    ``replicas`` None leaves the field out: an autoscaler that targets the workload owns it.
    """
    template = pod_template(session, tier, settings)
    selector = {"matchLabels": names.server_selector(session.name)}
    name = names.workload(session.name)
    metadata = session_metadata(session, name, "server")
    metadata["annotations"] = {MEMORY_ANNOTATION: memory_footprint(session, tier).describe()}
    if tier is not None and tier.storage.per_pod:
        claim_template = {
            "metadata": {"name": CACHE_VOLUME, "labels": {names.TIER_LABEL: tier.name}},
            "spec": {
                "accessModes": [tier.storage.access_mode],
                "resources": {"requests": {"storage": tier.storage.size}},
                **({"storageClassName": tier.storage.storage_class_name} if tier.storage.storage_class_name else {}),
            },
        }
        immutable = {
            "selector": selector,
            "serviceName": names.headless_service(session.name),
            "podManagementPolicy": "Parallel",
            "volumeClaimTemplates": [claim_template],
        }
        obj = {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": metadata,
            "spec": {
                **({"replicas": replicas} if replicas is not None else {}),
                **immutable,
                "template": template,
                "updateStrategy": {"type": "RollingUpdate"},
                # Deleting the session frees the disks; scaling down keeps them, so a later
                # scale-up finds its stored states again.
                "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
            },
        }
        return names.stamp(obj, immutable=immutable)
    obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            **({"replicas": replicas} if replicas is not None else {}),
            "selector": selector,
            "template": template,
            "strategy": deployment_strategy(session),
            "revisionHistoryLimit": 5,
        },
    }
    return names.stamp(obj)
