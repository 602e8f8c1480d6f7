"""Deterministic names, labels and the spec-hash of every object the operator owns."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from mambaserve.operator.settings import API_VERSION, GROUP

SESSION_LABEL = f"{GROUP}/session"
TIER_LABEL = f"{GROUP}/cache-tier"
METRICS_LABEL = f"{GROUP}/metrics"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGER = "mambaserve-operator"
SPEC_HASH = f"{GROUP}/spec-hash"
IMMUTABLE_HASH = f"{GROUP}/immutable-hash"


def workload(name: str) -> str:
    return name


def client_service(name: str) -> str:
    return name


def headless_service(name: str) -> str:
    return f"{name}-headless"


def config_map(name: str) -> str:
    return f"{name}-config"


def router(name: str) -> str:
    return f"{name}-router"


def model_claim(name: str) -> str:
    return f"{name}-model"


def kernel_claim(name: str) -> str:
    return f"{name}-kernels"


def model_job(name: str) -> str:
    return f"{name}-model-download"


def tier_claim(tier_name: str) -> str:
    return f"{tier_name}-storage"


def session_labels(name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "mambaserve",
        "app.kubernetes.io/instance": name,
        COMPONENT_LABEL: component,
        MANAGED_BY_LABEL: MANAGER,
        SESSION_LABEL: name,
    }


def server_selector(name: str) -> dict[str, str]:
    """Selects the server pods of one session; also the scale subresource's selector."""
    return {SESSION_LABEL: name, COMPONENT_LABEL: "server"}


def router_selector(name: str) -> dict[str, str]:
    return {SESSION_LABEL: name, COMPONENT_LABEL: "router"}


def selector_string(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def owner_reference(kind: str, name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def spec_hash(obj: Mapping[str, Any]) -> str:
    """Hash of everything the operator renders, excluding the hash annotations themselves."""
    meta = dict(obj.get("metadata") or {})
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k not in (SPEC_HASH, IMMUTABLE_HASH)}
    meta["annotations"] = annotations
    canonical = json.dumps({**obj, "metadata": meta}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def value_hash(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def stamp(obj: dict[str, Any], immutable: Any = None) -> dict[str, Any]:
    """Write the spec-hash (and, for objects with immutable parts, their hash) into annotations."""
    annotations = obj.setdefault("metadata", {}).setdefault("annotations", {})
    if immutable is not None:
        annotations[IMMUTABLE_HASH] = value_hash(immutable)
    annotations[SPEC_HASH] = spec_hash(obj)
    return obj
