"""The CRDs: well-formed for the API server, samples accepted, invalid objects rejected (schema + CEL)."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from mambaserve.operator.spec import parse_cache_tier, parse_session
from tests.operator.conftest import CRDS, SAMPLES, load_crd, load_yaml
from tests.operator.kube_versions import SUPPORTED
from mambaserve.operator.crd_schema import admit, all_rules, cel_program, structural_problems, version_schema

SESSIONS, TIERS = load_crd("inferencesessions"), load_crd("cachetiers")


def test_one_crd_per_file_and_named_after_it() -> None:
    files = sorted(p.name for p in CRDS.glob("*.yaml"))
    assert files == ["mambaserve.io_cachetiers.yaml", "mambaserve.io_inferencesessions.yaml"]
    for name in files:
        crd = load_yaml(CRDS / name)
        assert name == f"{crd['spec']['group']}_{crd['spec']['names']['plural']}.yaml"


@pytest.mark.parametrize("version", SUPPORTED)
@pytest.mark.parametrize("crd", [SESSIONS, TIERS], ids=["inferencesessions", "cachetiers"])
def test_crd_validates_against_apiextensions_schema(crd: dict[str, Any], version: str) -> None:
    # On the oldest claimed version too: e.g. a rule's fieldPath exists from 1.28 on.
    kubernetes_validate.validate(crd, version, strict=True)


@pytest.mark.parametrize("crd", [SESSIONS, TIERS], ids=["inferencesessions", "cachetiers"])
def test_crd_schema_is_structural_and_every_rule_compiles(crd: dict[str, Any]) -> None:
    schema = version_schema(crd)
    assert structural_problems(schema) == []
    rules = all_rules(schema)
    assert rules, "cross-field rules are expected"
    for rule in rules:
        cel_program(rule)  # compiles with a real CEL parser
        # Only the standard library: no Kubernetes CEL extensions that differ between versions.
        for ext in ("quantity(", ".split(", "url(", "isSorted(", ".lowerAscii("):
            assert ext not in rule


def test_inference_session_scale_subresource_and_columns() -> None:
    version = SESSIONS["spec"]["versions"][0]
    assert SESSIONS["spec"]["group"] == "mambaserve.io" and version["name"] == "v1alpha1"
    assert SESSIONS["spec"]["names"]["shortNames"] == ["isess"]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    columns = [c["name"].upper() for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["READY", "REPLICAS", "HIT-RATE", "SESSIONS", "AGE"]
    status = version_schema(SESSIONS)["properties"]["status"]["properties"]
    for field in ("observedGeneration", "phase", "replicas", "readyReplicas", "selector", "url",
                  "cacheHitRate", "openSessions", "conditions"):
        assert field in status
    types = status["conditions"]["items"]["properties"]["type"]["enum"]
    assert set(types) >= {"Ready", "Progressing", "Degraded", "CacheTierBound", "RouterReady", "Autoscaling"}


def test_cache_tier_names_and_status() -> None:
    assert TIERS["spec"]["names"]["shortNames"] == ["ctier"]
    status = version_schema(TIERS)["properties"]["status"]["properties"]
    for field in ("observedGeneration", "phase", "claimName", "boundSessions", "conditions"):
        assert field in status


SAMPLE_FILES = sorted(p.name for p in SAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("name", SAMPLE_FILES)
def test_samples_are_accepted(name: str) -> None:
    obj = load_yaml(SAMPLES / name)
    crd = SESSIONS if obj["kind"] == "InferenceSession" else TIERS
    stored, errors = admit(crd, obj)
    assert errors == []
    assert (SAMPLES / name).read_text().lstrip().startswith("#"), "samples start with a comment saying what they show"


def test_defaults_in_the_crd_match_the_operator() -> None:
    # The operator repeats the CRD defaults (for objects stored before a default existed); keep them equal.
    session_obj = {"apiVersion": "mambaserve.io/v1alpha1", "kind": "InferenceSession",
                   "metadata": {"name": "d", "namespace": "n"},
                   "spec": {"model": {"source": "/m", "tokenSecretRef": {"name": "s"}},
                            "server": {}, "sessions": {}, "resources": {}, "monitoring": {},
                            "autoscaling": {"scaleUp": {}, "scaleDown": {}}, "router": {}}}
    stored, errors = admit(SESSIONS, session_obj)
    assert errors == []
    assert parse_session(stored) == parse_session(session_obj)
    tier_obj = {"apiVersion": "mambaserve.io/v1alpha1", "kind": "CacheTier", "metadata": {"name": "t"},
                "spec": {"host": {}, "storage": {}, "gpu": {}}}
    stored, errors = admit(TIERS, tier_obj)
    assert errors == []
    assert parse_cache_tier(stored) == parse_cache_tier(tier_obj)


def _session(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "mambaserve.io/v1alpha1", "kind": "InferenceSession",
            "metadata": {"name": "s1", "namespace": "llm"}, "spec": {"model": {"source": "/models/m"}, **spec}}


def _tier(name: str = "t1", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "mambaserve.io/v1alpha1", "kind": "CacheTier",
            "metadata": {"name": name, "namespace": "llm"}, "spec": spec}


INVALID_SESSIONS = [
    ("min>max", _session(autoscaling={"enabled": True, "minReplicas": 5, "maxReplicas": 2}), "minReplicas must be less"),
    ("hpa to zero", _session(autoscaling={"enabled": True, "minReplicas": 0}), "come from the server pods"),
    ("keda to zero", _session(autoscaling={"enabled": True, "engine": "keda", "minReplicas": 0}),
     "minReplicas must be at least 1"),
    ("bad source scheme", _session(model={"source": "s3://bucket/model"}), "model.source must be"),
    ("hf without name", _session(model={"source": "hf://org"}), "model.source must be"),
    ("relative path", _session(model={"source": "models/m"}), "model.source must be"),
    ("operator-owned flag", _session(server={"extraArgs": ["--port=1"]}), "the operator owns them"),
    ("track without extra_buffer", _session(server={"trackInterval": 64}), "needs cacheStrategy extra_buffer"),
    ("bad enum", _session(server={"cacheStrategy": "everything"}), "cacheStrategy"),
    ("negative replicas", _session(replicas=-1), "replicas"),
    ("capacity-miss target 0", _session(autoscaling={"targetCapacityMissRatio": 0}), "targetCapacityMissRatio"),
    ("unknown field", _session(gpus=2), "Additional properties"),
    ("router policy", _session(router={"policy": "sticky"}), "policy"),
    ("toleration Exists+value", _session(placement={"tolerations": [{"key": "k", "operator": "Exists",
                                                                     "value": "v"}]}), "must not have a value"),
    ("no model", {**_session(), "spec": {"replicas": 1}}, "'model' is a required property"),
    ("long name", {**_session(), "metadata": {"name": "x" * 41}}, "at most 40 characters"),
    ("uppercase name", {**_session(), "metadata": {"name": "Chat"}}, "DNS-1035"),
    ("bad quantity", _session(resources={"requests": {"memory": "lots"}}), "does not match"),
    ("nine gpus", _session(resources={"gpus": 9}), "a pod's GPUs are one host's"),
    ("selector label in podTemplate", _session(podTemplate={"metadata": {"labels": {"mambaserve.io/session": "x"}}}),
     "the operator selects pods by them"),
    ("podTemplate unknown part", _session(podTemplate={"status": {}}), "Additional properties"),
    ("podTemplate spec not a map", _session(podTemplate={"spec": ["containers"]}), "is not of type 'object'"),
]


INVALID_TIERS = [
    ("storage without size", _tier(storage={"enabled": True}), "needs storage.size"),
    ("size and existing claim", _tier(storage={"enabled": True, "size": "1Gi", "existingClaim": "c"}),
     "mutually exclusive"),
    ("class with existing claim", _tier(storage={"enabled": True, "existingClaim": "c", "storageClassName": "x"}),
     "applies to new claims only"),
    ("slots and fraction", _tier(gpu={"stateSlots": 10, "memoryFraction": 0.5}), "mutually exclusive"),
    ("relative path", _tier(storage={"enabled": True, "size": "1Gi", "path": "cache"}), "absolute path"),
    ("dotdot path", _tier(storage={"enabled": True, "size": "1Gi", "path": "/a/../b"}), "absolute path"),
    ("bad write policy", _tier(writePolicy="sometimes"), "writePolicy"),
    ("access mode", _tier(storage={"enabled": True, "size": "1Gi", "accessMode": "ReadOnlyMany"}), "accessMode"),
    ("bad size", _tier(storage={"enabled": True, "size": "ten gigs"}), "does not match"),
]


INVALID = [("session", SESSIONS, *c) for c in INVALID_SESSIONS] + [("tier", TIERS, *c) for c in INVALID_TIERS]


@pytest.mark.parametrize("kind,crd,name,obj,message", INVALID, ids=[f"{c[0]}: {c[2]}" for c in INVALID])
def test_invalid_objects_are_rejected(kind: str, crd, name: str, obj: dict[str, Any], message: str) -> None:
    _, errors = admit(crd, obj)
    assert errors, f"{kind} {name!r} was accepted"
    assert any(message in e for e in errors), errors


IMMUTABLE_CHANGES = [
    ("size", {"size": "200Gi"}, "storage.size is immutable"),
    ("class", {"storageClassName": "slow"}, "storageClassName is immutable"),
    ("access mode", {"accessMode": "ReadWriteMany"}, "accessMode is immutable"),
]


@pytest.mark.parametrize("name,change,message", IMMUTABLE_CHANGES, ids=[c[0] for c in IMMUTABLE_CHANGES])
def test_tier_storage_shape_is_immutable(name: str, change: dict[str, Any], message: str) -> None:
    old = _tier(storage={"enabled": True, "size": "100Gi", "storageClassName": "fast"})
    new = copy.deepcopy(old)
    new["spec"]["storage"].update(change)
    _, errors = admit(TIERS, new, old=old)
    assert any(message in e for e in errors), errors
    # The same object is fine on create, and unrelated updates of the old one pass.
    assert admit(TIERS, new)[1] == []
    unrelated = copy.deepcopy(old)
    unrelated["spec"]["writePolicy"] = "write_through"
    assert admit(TIERS, unrelated, old=old)[1] == []


def test_tier_size_cannot_be_dropped_or_added_later() -> None:
    old = _tier(storage={"enabled": True, "size": "100Gi"})
    new = _tier(storage={"enabled": True, "existingClaim": "other"})
    assert any("storage.size is immutable" in e for e in admit(TIERS, new, old=old)[1])
    assert any("existingClaim is immutable" in e for e in admit(TIERS, new, old=old)[1])


VALID_EDGE_CASES = [
    _session(model={"source": "hf://state-spaces/mamba2-130m"}),
    _session(model={"source": "hf://org/name@v1.0/sub"}),
    _session(model={"source": "pvc://weights"}),
    _session(model={"source": "pvc://weights/dir/model"}),
    _session(autoscaling={"enabled": True, "engine": "keda", "minReplicas": 1, "maxReplicas": 3}),
    _session(replicas=0, autoscaling={"enabled": False, "minReplicas": 0}),  # parked by hand: allowed
    _session(autoscaling={"enabled": False, "minReplicas": 9, "maxReplicas": 2}),  # not checked while disabled
    _session(server={"cacheStrategy": "extra_buffer", "trackInterval": 256, "extraArgs": ["--seed", "7"]}),
    _session(resources={"gpus": 0, "requests": {"cpu": 2, "memory": "8Gi"}}),
    _session(resources={"gpus": 1}),
    _session(placement={"runtimeClassName": "nvidia", "topologySpreadConstraints": []}),
    _session(podTemplate={"metadata": {"labels": {"team": "a"}, "annotations": {"a/b": "c"}},
                          "spec": {"containers": [{"name": "server", "env": [{"name": "X", "value": "1"}]}],
                                   "volumes": [{"name": "v", "emptyDir": {}}]}}),
]


@pytest.mark.parametrize("obj", VALID_EDGE_CASES)
def test_valid_edge_cases_are_accepted(obj: dict[str, Any]) -> None:
    assert admit(SESSIONS, obj)[1] == []
