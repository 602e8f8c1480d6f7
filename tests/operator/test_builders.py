"""Pure builders: expected objects for representative specs, every object valid for its API server."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import kubernetes_validate
import pytest

from mambaserve.operator import names
from mambaserve.operator.builders import (adapter_rules, build_session_children, build_tier_claim, problems, routing,
                                          server_args)
from mambaserve.operator.builders.autoscaling import CAPACITY_MISS_METRIC, QUEUE_METRIC
from mambaserve.operator.settings import OperatorSettings
from mambaserve.operator.spec import parse_cache_tier, parse_session, session_problems
from tests.operator.conftest import DATA, ROOT, load_crd, load_yaml, sample
from mambaserve.operator.crd_schema import admit
from tests.operator.kube_versions import SUPPORTED
from tests.operator.pod_security import pod_templates, restricted_violations, writable_root_filesystems

THIRD_PARTY_CRDS = {
    "ScaledObject": load_yaml(DATA / "keda.sh_scaledobjects.yaml"),
    "ServiceMonitor": load_yaml(DATA / "monitoring.coreos.com_servicemonitors.yaml"),
}
SETTINGS = OperatorSettings(service_monitors=True, server_image="registry.local/mambaserve:1")
INTERFACE = (ROOT / "docs" / "server-interface.md").read_text()


def session(name: str, **meta: Any) -> Any:
    body = sample(name)
    body["metadata"].update({"uid": "uid-s", "generation": 1, **meta})
    return parse_session(body)


def tier(name: str) -> Any:
    body = sample(name)
    body["metadata"].update({"uid": "uid-t", "generation": 1})
    return parse_cache_tier(body)


def by_kind(children: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


SCENARIOS = {
    "minimal": lambda: build_session_children(session("inferencesession-minimal"), None, SETTINGS),
    "autoscaled+shared": lambda: build_session_children(session("inferencesession-autoscaled"),
                                                        tier("cachetier-shared"), SETTINGS),
    "keda+per-pod": lambda: build_session_children(session("inferencesession-keda"),
                                                   tier("cachetier-per-pod"), SETTINGS),
    "platform": lambda: build_session_children(session("inferencesession-platform"), None, SETTINGS),
    "model-cache": lambda: build_session_children(session("inferencesession-model-cache"), None, SETTINGS),
}


def assert_valid(obj: dict[str, Any]) -> None:
    if obj["kind"] in THIRD_PARTY_CRDS:
        _, errors = admit(THIRD_PARTY_CRDS[obj["kind"]], obj)
        assert errors == [], errors
        return
    for version in SUPPORTED:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_object_validates_against_official_schemas(scenario: str) -> None:
    children = SCENARIOS[scenario]()
    for obj in children:
        assert_valid(obj)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_pod_is_admitted_by_pod_security_restricted(scenario: str) -> None:
    children = SCENARIOS[scenario]()
    pods = [obj for obj in children if list(pod_templates(obj))]
    assert pods
    for obj in pods:
        assert restricted_violations(obj) == []
        assert writable_root_filesystems(obj) == []
        for _, spec in pod_templates(obj):
            for c in spec["containers"] + spec.get("initContainers", []):
                # Burstable or Guaranteed: the kubelet evicts BestEffort pods first.
                named = set(c["resources"].get("requests", {})) | set(c["resources"].get("limits", {}))
                assert {"cpu", "memory"} <= named, c["name"]


def test_tier_claim_validates() -> None:
    claim = build_tier_claim(tier("cachetier-shared"))
    assert claim is not None
    assert_valid(claim)
    assert claim["metadata"]["name"] == "shared-tier-storage"
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "500Gi"}},
                             "storageClassName": "nfs-client"}
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "CacheTier"
    assert build_tier_claim(tier("cachetier-per-pod")) is None  # per-pod claims come from the StatefulSet


def test_minimal_session_objects() -> None:
    children = by_kind(SCENARIOS["minimal"]())
    assert sorted(children) == [("ConfigMap", "tiny-config"), ("Deployment", "tiny"),
                                ("PodDisruptionBudget", "tiny"), ("Service", "tiny"), ("Service", "tiny-headless"),
                                ("ServiceMonitor", "tiny")]
    dep = children["Deployment", "tiny"]
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["selector"] == {"matchLabels": {"mambaserve.io/session": "tiny",
                                                       "app.kubernetes.io/component": "server"}}
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry.local/mambaserve:1"
    assert container["command"] == ["mambaserve", "serve"]
    assert container["args"] == [
        "--model", "/models/mamba2-130m", "--host", "0.0.0.0", "--port", "30000", "--device", "cuda",
        "--dtype", "auto", "--state-dtype", "float32", "--chunked-prefill-size", "2048",
        "--mamba-cache-strategy", "no_buffer", "--max-sessions", "1024", "--session-timeout", "600",
        "--drain-timeout", "55", "--log-level", "info", "--served-model-name", "mamba2-130m",
        "--session-snapshot-dir", "/var/lib/mambaserve/sessions",
    ]
    # memory: runtime 4Gi + an unknown checkpoint's 8Gi + pinned 1Gi + /dev/shm 2Gi, requested and limited
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "15Gi", "nvidia.com/gpu": "1"},
                                      "limits": {"memory": "15Gi", "nvidia.com/gpu": "1"}}
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # liveness from progress: a step stuck for 300 s with requests pending restarts the pod; idle does not
    assert container["livenessProbe"]["httpGet"] == {"path": "/health?stuck_step_timeout=300", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": 30000, "protocol": "TCP"}]
    # Streaming sessions drain: a preStop exec of the image's Python (works on every supported
    # Kubernetes, unlike the sleep action), then the server's own drain (SIGTERM: in-flight turns finish, sessions
    # written) within terminationGracePeriodSeconds (60) less 5 s for its exit; the grace period covers all three.
    assert container["lifecycle"] == {"preStop": {"exec": {"command": ["python3", "-c", "import time; time.sleep(30)"]}}}
    assert pod["terminationGracePeriodSeconds"] == 30 + int(container["args"][container["args"].index("--drain-timeout") + 1]) + 5
    # Read-only root: every place the server writes is a volume, and the libraries are told where.
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/tmp", env["HOME"], "/var/lib/mambaserve/sessions", "/dev/shm"):
        assert "emptyDir" in volumes[mounts[path]], path
    for variable in ("TRITON_CACHE_DIR", "HF_HOME"):
        assert env[variable].startswith(env["HOME"] + "/")
    assert env["TMPDIR"] == "/tmp"
    assert container["args"][container["args"].index("--session-snapshot-dir") + 1] == "/var/lib/mambaserve/sessions"
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    # A GPU pod tolerates the GPU taint and spreads over nodes and zones without ever staying Pending for it.
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    spread = pod["topologySpreadConstraints"]
    assert [c["topologyKey"] for c in spread] == ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
    assert all(c["whenUnsatisfiable"] == "ScheduleAnyway" and c["labelSelector"]["matchLabels"] ==
               names.server_selector("tiny") for c in spread)
    assert "initContainers" not in pod
    assert not any(e["name"] == "MAMBASERVE_API_KEY" for e in container["env"])
    svc = children["Service", "tiny"]
    assert svc["spec"]["selector"] == names.server_selector("tiny")
    assert svc["spec"]["sessionAffinity"] == "ClientIP"  # no router: keep a client's turns on one pod
    headless = children["Service", "tiny-headless"]
    assert headless["spec"]["clusterIP"] == "None"
    for obj in children.values():
        ref = obj["metadata"]["ownerReferences"]
        assert ref == [{"apiVersion": "mambaserve.io/v1alpha1", "kind": "InferenceSession", "name": "tiny",
                        "uid": "uid-s", "controller": True, "blockOwnerDeletion": True}]
        assert obj["metadata"]["labels"]["mambaserve.io/session"] == "tiny"
        assert re.fullmatch(r"[0-9a-f]{20}", obj["metadata"]["annotations"][names.SPEC_HASH])


def test_autoscaled_session_with_shared_tier() -> None:
    s, t = session("inferencesession-autoscaled"), tier("cachetier-shared")
    children = by_kind(build_session_children(s, t, SETTINGS))
    dep = children["Deployment", "chat"]
    pod = dep["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    valued = [a for a in args if a != "--session-persist"]
    flags = dict(zip(valued[::2], valued[1::2]))
    assert flags["--mamba-cache-size"] == "4096"
    assert flags["--host-cache-size"] == "32GiB"  # the host tier (L2)
    # the storage tier (L3) on the shared claim: its states/ directory, 85% of the 500Gi claim, the
    # tier's policies; session snapshots in its sessions/ directory with 10% of the claim
    assert flags["--storage-dir"] == "/var/cache/mambaserve/states"
    assert int(flags["--storage-size"]) == int(500 * 2**30 * 0.85)
    assert flags["--cache-write-policy"] == "write_through_selective"
    assert flags["--cache-prefetch-policy"] == "best_effort"
    assert flags["--session-snapshot-dir"] == "/var/cache/mambaserve/sessions"
    assert int(flags["--session-snapshot-max-bytes"]) == int(500 * 2**30 * 0.10)
    assert "--session-persist" in args  # sessions.persist: true in this sample
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "cache")
    assert mount == {"name": "cache", "mountPath": "/var/cache/mambaserve"} and not mount.get("readOnly")
    assert flags["--mamba-track-interval"] == "1024" and flags["--max-running-requests"] == "256"
    cache = [v for v in pod["volumes"] if v["name"] == "cache"]
    assert cache == [{"name": "cache", "persistentVolumeClaim": {"claimName": "shared-tier-storage"}}]
    # runtime 4Gi + checkpoint 11Gi + host tier 32Gi + pinned 1Gi + /dev/shm 2Gi
    assert pod["containers"][0]["resources"]["requests"]["memory"] == "50Gi"
    assert pod["containers"][0]["resources"]["limits"]["memory"] == "50Gi"
    # the API key reaches the server from its Secret, never through the args
    assert {"name": "MAMBASERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "chat-api-key", "key": "api-key"}}} \
        in pod["containers"][0]["env"]
    assert not any("api-key" in a for a in args)
    # hf:// model: downloaded by an init container with the token from the secret.
    init = pod["initContainers"][0]
    assert init["command"][-3:] == ["state-spaces/mamba2-2.7b", "main", "/models/mamba2-2.7b"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in init["env"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["priorityClassName"] == "inference-high"

    hpa = children["HorizontalPodAutoscaler", "chat"]["spec"]
    # The autoscaler scales the workload itself (scaling goes on while the operator is down), and the
    # workload leaves its replicas to it.
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "chat"}
    assert "replicas" not in dep["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 8)
    assert hpa["metrics"][0]["pods"] == {"metric": {"name": CAPACITY_MISS_METRIC},
                                         "target": {"type": "AverageValue", "averageValue": "50m"}}
    assert hpa["metrics"][1]["pods"]["metric"]["name"] == QUEUE_METRIC
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 900

    router = children["Deployment", "chat-router"]["spec"]
    rc = router["template"]["spec"]["containers"][0]
    assert rc["command"] == ["python3", "-m", "sglang_router.launch_router"]
    # Pinned (a moving tag would swap the router under running sessions), scraped, and drained one at a time.
    assert rc["image"] == SETTINGS.router_image and not rc["image"].endswith(":latest") and ":" in rc["image"]
    assert children["PodDisruptionBudget", "chat-router"]["spec"] == {
        "maxUnavailable": 1, "selector": {"matchLabels": names.router_selector("chat")},
        "unhealthyPodEvictionPolicy": "AlwaysAllow"}
    router_monitor = children["ServiceMonitor", "chat-router"]
    assert router_monitor["spec"]["selector"]["matchLabels"] == names.router_selector("chat")
    assert router_monitor["spec"]["endpoints"][0]["port"] == "metrics"
    client_ports = {p["name"]: p for p in children["Service", "chat"]["spec"]["ports"]}
    assert client_ports["metrics"]["targetPort"] == "metrics"
    assert {"name": "metrics", "containerPort": client_ports["metrics"]["port"], "protocol": "TCP"} in rc["ports"]
    assert router_monitor["spec"]["selector"]["matchLabels"].items() <= \
        children["Service", "chat"]["metadata"]["labels"].items()
    assert rc["args"][rc["args"].index("--selector") + 1:rc["args"].index("--service-discovery-namespace")] == [
        "app.kubernetes.io/component=server", "mambaserve.io/session=chat"]
    assert "--service-discovery" in rc["args"] and rc["args"][rc["args"].index("--policy") + 1] == "cache_aware"
    assert router["replicas"] == 2
    assert router["template"]["spec"]["serviceAccountName"] == "chat-router"
    role = children["Role", "chat-router"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = children["RoleBinding", "chat-router"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "llm"}]
    # With a router, the client service points at the router, not at the server pods.
    assert children["Service", "chat"]["spec"]["selector"] == names.router_selector("chat")
    assert "sessionAffinity" not in children["Service", "chat"]["spec"]
    monitor = children["ServiceMonitor", "chat"]["spec"]
    assert monitor["selector"]["matchLabels"] == {"mambaserve.io/session": "chat", "mambaserve.io/metrics": "true"}
    # A default kube-prometheus-stack Prometheus selects monitors by its release label.
    for name in ("chat", "chat-router"):
        assert children["ServiceMonitor", name]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The server ServiceMonitor's selector must not pick the client service (router metrics are on another port).
    assert not monitor["selector"]["matchLabels"].items() <= children["Service", "chat"]["metadata"]["labels"].items()
    assert children["Service", "chat-headless"]["metadata"]["labels"]["mambaserve.io/metrics"] == "true"
    assert "mambaserve.io/metrics" not in children["Service", "chat"]["metadata"]["labels"]


def test_keda_session_with_per_pod_tier_runs_as_statefulset() -> None:
    children = by_kind(SCENARIOS["keda+per-pod"]())
    assert ("Deployment", "agents") not in children
    sts = children["StatefulSet", "agents"]["spec"]
    assert sts["serviceName"] == "agents-headless"
    assert sts["volumeClaimTemplates"][0]["spec"] == {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "200Gi"}},
        "storageClassName": "local-nvme"}
    assert sts["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    pod = sts["template"]["spec"]
    assert {"name": "cache", "mountPath": "/var/cache/mambaserve"} in pod["containers"][0]["volumeMounts"]
    assert not [v for v in pod["volumes"] if v["name"] == "cache"]  # from the claim template instead
    model = [v for v in pod["volumes"] if v["name"] == "model"][0]
    assert model["persistentVolumeClaim"] == {"claimName": "model-weights", "readOnly": True}
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/mamba2-1.3b"

    so = children["ScaledObject", "agents"]["spec"]
    assert so["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "agents"}
    assert "replicas" not in sts
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == (1, 4)
    trigger = so["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert trigger["metadata"]["threshold"] == "0.1"
    # capacity misses over queried tokens: compulsory misses (never-seen prefixes) do not scale
    assert trigger["metadata"]["query"].startswith("(sum(rate(mambaserve_prefix_cache_capacity_miss_tokens_total{")
    assert trigger["metadata"]["query"].endswith(" or vector(0.1)")  # never NaN: idle holds at the target
    assert "mambaserve_prefix_cache_hit_tokens_total" not in trigger["metadata"]["query"]
    assert 'mambaserve_io_session="agents"' in trigger["metadata"]["query"]
    assert ("HorizontalPodAutoscaler", "agents") not in children
    router = children["Deployment", "agents-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert router[router.index("--policy") + 1] == "manual"
    assert router[router.index("--assignment-mode") + 1] == "min_group"  # new sessions spread over the pods
    # the real router's own parser takes them; a killed or draining pod loses its keys within ~10 s
    parsed = pytest.importorskip("sglang_router.launch_router").parse_router_args(router)
    assert (parsed.policy, parsed.health_check_interval_secs, parsed.health_failure_threshold) == ("manual", 5, 2)


@pytest.mark.parametrize("sessions, policy, mode", [
    ({}, "manual", "min_group"),  # streaming sessions by default: sticky
    ({"streaming": False}, "cache_aware", None),
])
def test_router_policy_auto_is_sticky_when_the_pods_keep_sessions(sessions: dict[str, Any], policy: str,
                                                                   mode: str | None) -> None:
    body = sample("inferencesession-minimal")
    body["metadata"].update({"uid": "uid-s", "generation": 1})
    body["spec"].update(router={"enabled": True}, sessions=sessions)
    stored, errors = admit(load_crd("inferencesessions"), body)  # the CRD's default policy is auto
    assert not errors and stored["spec"]["router"]["policy"] == "auto"
    chosen = routing(parse_session(stored))
    args = by_kind(build_session_children(parse_session(stored), None, SETTINGS))[
        "Deployment", "tiny-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--policy") + 1] == chosen.policy == policy
    assert (args[args.index("--assignment-mode") + 1] if "--assignment-mode" in args else None) == mode
    assert chosen.as_status()["policy"] == policy and chosen.as_status().get("assignmentMode") == mode
    assert chosen.as_status()["reason"].startswith("auto: ")
    # A policy set in the spec is taken as given, sessions or not.
    body["spec"]["router"]["policy"] = "round_robin"
    assert routing(parse_session(admit(load_crd("inferencesessions"), body)[0])).as_status() == {
        "policy": "round_robin", "reason": "router.policy"}


def test_memory_request_and_limit_cover_everything_the_pod_holds() -> None:
    """A 32 GB host tier is pinned host memory: it is requested and limited with the rest (it was left out,
    so a 32 GB tier rendered a 16Gi request and no limit)."""
    body = sample("inferencesession-minimal")
    body["metadata"]["uid"] = "u"
    t = tier("cachetier-shared")
    children = by_kind(build_session_children(parse_session(body), t, SETTINGS))
    dep = children["Deployment", "tiny"]
    resources = dep["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "47Gi"
    assert dep["metadata"]["annotations"]["mambaserve.io/memory"] == (
        "runtime 4Gi + weights 8Gi (allowance for an unknown checkpoint: set model.checkpointSize) + host tier 32Gi "
        "(CacheTier shared-tier host.sizeGb) + pinned buffers 1Gi + /dev/shm 2Gi = 47Gi")
    assert json.loads(children["ConfigMap", "tiny-config"]["data"]["effective-config.json"])["memory"].endswith("= 47Gi")
    # The checkpoint's size replaces the allowance; a storage tier without host memory stages its reads.
    body["spec"]["model"]["checkpointSize"] = "2.5Gi"
    no_host = tier("cachetier-per-pod")
    no_host = dataclasses.replace(no_host, host_size_gb=0.0)
    dep = by_kind(build_session_children(parse_session(body), no_host, SETTINGS))["StatefulSet", "tiny"]
    assert dep["metadata"]["annotations"]["mambaserve.io/memory"] == (
        "runtime 4Gi + weights 2560Mi (model.checkpointSize) + storage staging 2Gi + pinned buffers 1Gi "
        "+ /dev/shm 2Gi = 12Gi")
    # A request the spec names is kept, and reported when it is below the footprint.
    body["spec"]["resources"] = {"requests": {"memory": "32Gi"}}
    s = parse_session(body)
    resources = by_kind(build_session_children(s, t, SETTINGS))["Deployment", "tiny"]["spec"]["template"]["spec"][
        "containers"][0]["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "32Gi"
    [problem] = problems(s, t)
    assert problem.reason == "MemoryBelowFootprint" and "= 42Gi" in problem.message


@pytest.mark.parametrize(("resources", "rollout", "expected"), [
    # a GPU pool with no spare GPU declared: an old pod stops before its replacement starts (a surge pod
    # would wait Pending for the GPU the old one holds, until the progress deadline)
    ({}, None, {"maxSurge": 0, "maxUnavailable": 1}),
    ({}, {"spareGpus": 2}, {"maxSurge": 2, "maxUnavailable": 0}),
    ({"gpus": 1}, {"spareGpus": 3, "strategy": "Replace"}, {"maxSurge": 0, "maxUnavailable": 1}),
    ({}, {"strategy": "Surge"}, {"maxSurge": 1, "maxUnavailable": 0}),
    ({"gpus": 0}, None, {"maxSurge": 1, "maxUnavailable": 0}),  # CPU is not scarce
])
def test_rollout_strategy_follows_the_spare_gpus(resources: dict[str, Any], rollout: Any,
                                                  expected: dict[str, int]) -> None:
    body = sample("inferencesession-minimal")
    body["metadata"]["uid"] = "u"
    body["spec"]["resources"] = resources
    if rollout is not None:
        body["spec"]["rollout"] = rollout
    s = parse_session(body)
    dep = by_kind(build_session_children(s, None, SETTINGS))["Deployment", "tiny"]
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": expected}
    # A StatefulSet cannot surge: asked for explicitly, that is reported.
    body["spec"]["rollout"] = {"strategy": "Surge", "spareGpus": 1}
    assert [p.reason for p in problems(parse_session(body), tier("cachetier-per-pod"))] == ["SurgeNotPossible"]


def test_network_policy_lets_only_the_namespace_the_operator_and_prometheus_reach_the_servers() -> None:
    settings = OperatorSettings(network_policies=True, operator_namespace="mambaserve-system",
                                metrics_namespaces=("monitoring",))
    children = by_kind(build_session_children(session("inferencesession-minimal"), None, settings))
    policy = children["NetworkPolicy", "tiny"]
    assert_valid(policy)
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": names.server_selector("tiny")} and spec["policyTypes"] == ["Ingress"]
    [rule] = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 30000}]
    assert rule["from"] == [{"podSelector": {}},
                            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mambaserve-system"}}},
                            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert ("NetworkPolicy", "tiny") not in by_kind(SCENARIOS["minimal"]())  # off unless asked for


def test_kernel_cache_outlives_the_pods_on_a_claim() -> None:
    """spec.kernelCache (issue 28): Triton's compile cache on a claim the session owns, mounted in every pod
    and named to the server (--kernel-cache-dir), so a restarted pod loads its kernels instead of compiling."""
    from mambaserve.operator.crd_schema import admit
    from tests.operator.conftest import load_crd

    body = sample("inferencesession-minimal")
    body["metadata"]["uid"] = "u"
    body["spec"]["kernelCache"] = {"enabled": True, "size": "2Gi"}
    stored, errors = admit(load_crd("inferencesessions"), body)
    assert errors == []
    children = by_kind(build_session_children(parse_session(stored), None, SETTINGS))
    claim = children["PersistentVolumeClaim", "tiny-kernels"]
    assert_valid(claim)
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "2Gi"}}}
    pod = children["Deployment", "tiny"]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--kernel-cache-dir") + 1] == "/var/lib/mambaserve/kernels"
    assert {"name": "kernels", "mountPath": "/var/lib/mambaserve/kernels"} in pod["containers"][0]["volumeMounts"]
    assert {"name": "kernels", "persistentVolumeClaim": {"claimName": "tiny-kernels"}} in pod["volumes"]
    # A claim of the user's instead; a single-node claim under several pods is reported.
    body["spec"]["kernelCache"] = {"enabled": True, "existingClaim": "triton-cache", "accessMode": "ReadWriteOnce"}
    body["spec"]["replicas"] = 2
    s = parse_session(admit(load_crd("inferencesessions"), body)[0])
    children = by_kind(build_session_children(s, None, SETTINGS))
    assert ("PersistentVolumeClaim", "tiny-kernels") not in children
    assert {"name": "kernels", "persistentVolumeClaim": {"claimName": "triton-cache"}} in \
        children["Deployment", "tiny"]["spec"]["template"]["spec"]["volumes"]
    assert [p.reason for p in problems(s, None)] == ["KernelCacheSingleNode"]
    body["spec"]["kernelCache"] = {"enabled": True}
    assert any("kernelCache.enabled needs" in e for e in admit(load_crd("inferencesessions"), body)[1])
    assert "--kernel-cache-dir" not in server_args(session("inferencesession-minimal"), None)  # off by default


def test_platform_session_placement_and_pod_template_merged_last() -> None:
    children = by_kind(SCENARIOS["platform"]())
    template = children["Deployment", "platform"]["spec"]["template"]
    pod, meta = template["spec"], template["metadata"]
    assert pod["runtimeClassName"] == "nvidia" and pod["nodeSelector"] == {"pool": "inference"}
    # The GPU taint first (the pod asks for a GPU), then the user's own.
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                  {"key": "dedicated", "operator": "Equal", "value": "inference",
                                   "effect": "NoSchedule"}]
    assert [c["whenUnsatisfiable"] for c in pod["topologySpreadConstraints"]] == ["DoNotSchedule"]  # replaced
    assert meta["annotations"] == {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
    assert meta["labels"]["team"] == "ml-platform" and meta["labels"][names.SESSION_LABEL] == "platform"
    (server,) = pod["containers"]
    # Merged by name into the operator's container: its own env, mounts and args stay.
    env = [e["name"] for e in server["env"]]
    assert env[-1] == "SSL_CERT_FILE" and "POD_NAME" in env and "HOME" in env
    assert {"name": "corp-ca", "mountPath": "/etc/ssl/corp", "readOnly": True} in server["volumeMounts"]
    assert server["args"][:2] == ["--model", "/models/mamba2-1.3b"] and server["securityContext"]["readOnlyRootFilesystem"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["sessions"] == {"name": "sessions", "emptyDir": {"sizeLimit": "64Gi"}}  # replaced by name
    assert volumes["corp-ca"] == {"name": "corp-ca", "configMap": {"name": "corp-ca-bundle"}}
    assert {"tmp", "home", "dshm", "model"} <= set(volumes)
    # A limit alone: no default request is added next to it (it could exceed the limit).
    assert server["resources"] == {"requests": {"cpu": "4", "nvidia.com/gpu": "1"},
                                   "limits": {"memory": "24Gi", "nvidia.com/gpu": "1"}}


def test_pod_template_can_remove_and_replace_what_the_operator_renders() -> None:
    body = sample("inferencesession-minimal")
    body["metadata"]["uid"] = "u"
    body["spec"]["podTemplate"] = {"spec": {
        "tolerations": [{"key": "only-this", "operator": "Exists"}],  # lists without a merge key: replaced
        "topologySpreadConstraints": None,  # null removes the key
        "volumes": [{"name": "dshm", "$patch": "delete"}],
        "containers": [{"name": "server", "volumeMounts": [{"mountPath": "/dev/shm", "$patch": "delete"}]},
                       {"name": "sidecar", "image": "busybox:1.36", "$patch": "merge"}],
        "securityContext": {"runAsUser": 1000},
        "shareProcessNamespace": True,
    }}
    children = by_kind(build_session_children(parse_session(body), None, SETTINGS))
    pod = children["Deployment", "tiny"]["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "only-this", "operator": "Exists"}]
    assert "topologySpreadConstraints" not in pod
    assert "dshm" not in {v["name"] for v in pod["volumes"]}
    assert "/dev/shm" not in {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert [c["name"] for c in pod["containers"]] == ["server", "sidecar"]
    assert pod["containers"][1] == {"name": "sidecar", "image": "busybox:1.36"}
    assert pod["securityContext"]["runAsUser"] == 1000 and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["shareProcessNamespace"] is True
    # What the user adds is theirs to keep compliant: the sidecar has no security context.
    assert restricted_violations(children["Deployment", "tiny"])


def test_builders_are_deterministic_and_hash_follows_the_spec() -> None:
    first = SCENARIOS["autoscaled+shared"]()
    assert first == SCENARIOS["autoscaled+shared"]()
    body = sample("inferencesession-autoscaled")
    body["metadata"].update({"uid": "uid-s"})
    body["spec"]["server"]["chunkedPrefillSize"] = 8192
    changed = by_kind(build_session_children(parse_session(body), tier("cachetier-shared"), SETTINGS))
    before = by_kind(first)
    h = names.SPEC_HASH
    assert changed["Deployment", "chat"]["metadata"]["annotations"][h] != \
        before["Deployment", "chat"]["metadata"]["annotations"][h]
    assert changed["Service", "chat"]["metadata"]["annotations"][h] == \
        before["Service", "chat"]["metadata"]["annotations"][h]


def test_monitor_labels_come_from_the_settings() -> None:
    s = session("inferencesession-minimal")
    custom = OperatorSettings(service_monitors=True, monitor_labels=(("release", "prom"), ("team", "ml")))
    labels = by_kind(build_session_children(s, None, custom))["ServiceMonitor", "tiny"]["metadata"]["labels"]
    assert labels["release"] == "prom" and labels["team"] == "ml" and labels[names.SESSION_LABEL] == "tiny"
    none = OperatorSettings(service_monitors=True, monitor_labels=())
    assert "release" not in by_kind(build_session_children(s, None, none))["ServiceMonitor", "tiny"]["metadata"]["labels"]


def test_cpu_session_and_disabled_features() -> None:
    body = sample("inferencesession-minimal")
    body["metadata"]["uid"] = "u"
    body["spec"].update({"resources": {"gpus": 0, "requests": {"cpu": 4}}, "sessions": {"streaming": False},
                         "monitoring": {"enabled": False}, "terminationGracePeriodSeconds": 20})
    children = by_kind(build_session_children(parse_session(body), None, SETTINGS))
    container = children["Deployment", "tiny"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--device") + 1] == "cpu"
    # cpu as asked; memory from the footprint (runtime 2Gi + 1Gi checkpoint twice + state pool 2Gi + /dev/shm 2Gi);
    # no GPU, so no GPU toleration.
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}
    assert "tolerations" not in children["Deployment", "tiny"]["spec"]["template"]["spec"]
    assert "lifecycle" not in container  # no preStop wait without streaming sessions; the server still drains
    assert container["args"][container["args"].index("--drain-timeout") + 1] == "15"
    assert children["Deployment", "tiny"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 20
    assert ("ServiceMonitor", "tiny") not in children
    for obj in children.values():
        assert_valid(obj)


def test_a_pod_of_two_gpus_shards_its_model_over_them() -> None:
    body = sample("inferencesession-minimal")
    body["metadata"]["uid"] = "u"
    body["spec"]["resources"] = {"gpus": 2}
    stored, errors = admit(load_crd("inferencesessions"), body)
    assert errors == []  # (up to 8: test_crds)
    children = by_kind(build_session_children(parse_session(stored), None, SETTINGS))
    pod = children["Deployment", "tiny"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "2"
    # one pod holds both GPUs; a process per GPU: runtime 2 x 4Gi + 8Gi unknown checkpoint + pinned 2 x 1Gi +
    # /dev/shm 2Gi (memory-backed: NCCL's shared-memory transport and PyTorch's IPC live there)
    assert container["resources"] == {"requests": {"cpu": "5", "memory": "20Gi", "nvidia.com/gpu": "2"},
                                      "limits": {"memory": "20Gi", "nvidia.com/gpu": "2"}}
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    for obj in children.values():
        assert_valid(obj)


def _documented_flags() -> set[str]:
    return set(re.findall(r"`(--[a-z-]+)", INTERFACE))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_server_flags_are_the_documented_ones(scenario: str) -> None:
    documented = _documented_flags()
    for obj in SCENARIOS[scenario]():
        if obj["kind"] in ("Deployment", "StatefulSet") and obj["metadata"]["labels"][names.COMPONENT_LABEL] == "server":
            args = obj["spec"]["template"]["spec"]["containers"][0]["args"]
            used = {a for a in args if a.startswith("--")}
            assert used <= documented, used - documented


def test_metric_names_are_the_documented_ones() -> None:
    from mambaserve.operator import status
    from mambaserve.operator.builders import autoscaling
    for metric in (status.HIT_RATE, status.SESSIONS_OPEN, QUEUE_METRIC, autoscaling._CAPACITY_MISSES, autoscaling._QUERIED,
                   "mambaserve_operator_reconciles_total", "mambaserve_operator_reconcile_errors_total",
                   "mambaserve_operator_reconcile_duration_seconds"):
        assert f"`{metric}`" in INTERFACE, metric


def test_adapter_rules_serve_the_metrics_the_hpa_asks_for() -> None:
    rules = adapter_rules()["rules"]
    served = {r["name"]["as"] for r in rules}
    assert served == {CAPACITY_MISS_METRIC, QUEUE_METRIC}
    for rule in rules:
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


def test_server_args_without_tier_have_no_tier_flags() -> None:
    args = server_args(session("inferencesession-minimal"), None)
    assert not {"--storage-dir", "--storage-size", "--host-cache-size", "--mem-fraction-static",
                "--mamba-cache-size", "--cache-write-policy", "--cache-prefetch-policy", "--session-persist"} & set(args)


def test_gpu_memory_fraction_and_host_size_become_server_flags() -> None:
    body = sample("cachetier-shared")
    body["metadata"].update({"uid": "uid-t", "generation": 1})
    body["spec"]["gpu"] = {"memoryFraction": 0.8}
    t = parse_cache_tier(body)
    flags = dict(zip(*[iter(a for a in server_args(session("inferencesession-autoscaled"), t) if a != "--session-persist")] * 2))
    assert flags["--mem-fraction-static"] == "0.8" and flags["--host-cache-size"] == "32GiB"
    assert "--mamba-cache-size" not in flags


def test_storage_tier_settings_become_server_flags() -> None:
    """Every CacheTier setting has its server flag: nothing is left unsupported."""
    body = sample("cachetier-per-pod")
    body["metadata"].update({"uid": "uid-t", "generation": 1})
    body["spec"].update({"writePolicy": "write_through", "prefetchPolicy": "timeout"})
    body["spec"]["storage"]["path"] = "/mnt/l3/"
    s = sample("inferencesession-minimal")
    s["metadata"].update({"uid": "uid-s", "generation": 1})
    s["spec"]["sessions"] = {"persist": True}
    s["spec"]["cacheTierRef"] = {"name": "local-nvme"}
    sess, t = parse_session(s), parse_cache_tier(body)
    args = server_args(sess, t)
    flags = dict(zip(*[iter(a for a in args if a != "--session-persist")] * 2))
    assert flags["--storage-dir"] == "/mnt/l3/states" and flags["--session-snapshot-dir"] == "/mnt/l3/sessions"
    assert (flags["--cache-write-policy"], flags["--cache-prefetch-policy"]) == ("write_through", "timeout")
    assert "--session-persist" in args
    assert session_problems(sess, t) == []  # persist with storage: nothing to report
    # The per-pod claim (StatefulSet) is mounted read-write at the tier's path.
    workload = by_kind(build_session_children(sess, t, SETTINGS))["StatefulSet", "tiny"]
    container = workload["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "cache", "mountPath": "/mnt/l3/"} in container["volumeMounts"]
    # An existing claim: its size is unknown, so the server sizes the tier from the free space.
    body["spec"]["storage"] = {"enabled": True, "existingClaim": "nvme", "accessMode": "ReadWriteMany"}
    args = server_args(sess, parse_cache_tier(body))
    assert "--storage-dir" in args and "--storage-size" not in args and "--session-snapshot-max-bytes" not in args
    # persist without storage: no flag, and the session reports why.
    plain = server_args(sess, None)
    assert "--session-persist" not in plain
    assert [p.reason for p in session_problems(sess, None)] == ["PersistenceNeedsStorage"]
