"""Claims: the CacheTier's shared storage claim (ReadWriteMany tiers only), and a session's kernel cache."""

from __future__ import annotations

from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.spec import CacheTier, InferenceSession


def build_tier_claim(tier: CacheTier) -> dict[str, Any] | None:
    """The claim all pods of all bound sessions share, or None when the tier needs none."""
    if not tier.storage.shared_claim_created:
        return None
    spec: dict[str, Any] = {
        "accessModes": [tier.storage.access_mode],
        "resources": {"requests": {"storage": tier.storage.size}},
    }
    if tier.storage.storage_class_name:
        spec["storageClassName"] = tier.storage.storage_class_name
    obj = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": names.tier_claim(tier.name),
            "namespace": tier.namespace,
            "labels": {
                "app.kubernetes.io/name": "mambaserve",
                "app.kubernetes.io/component": "cache-storage",
                names.MANAGED_BY_LABEL: names.MANAGER,
                names.TIER_LABEL: tier.name,
            },
            "ownerReferences": [names.owner_reference("CacheTier", tier.name, tier.uid)],
        },
        "spec": spec,
    }
    return names.stamp(obj, immutable=spec)


def build_kernel_claim(session: InferenceSession) -> dict[str, Any] | None:
    """The claim the session's kernel cache lives on, or None (off, or a claim of the user's)."""
    cache = session.kernel_cache
    if not cache.enabled or cache.existing_claim:
        return None
    return session_claim(session, names.kernel_claim(session.name), "kernel-cache", cache.size or "",
                         cache.access_mode, cache.storage_class_name)


def session_claim(session: InferenceSession, name: str, component: str, size: str, access_mode: str,
                  storage_class: str | None) -> dict[str, Any]:
    """A claim the session owns; its spec is fixed once bound (the immutable hash re-creation refuses claims)."""
    spec: dict[str, Any] = {"accessModes": [access_mode], "resources": {"requests": {"storage": size}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    obj = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": session_metadata(session, name, component), "spec": spec}
    return names.stamp(obj, immutable=spec)
