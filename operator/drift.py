"""Whether a live object still is what the operator applied: pure functions over plain dicts.

The operator writes its children with server-side apply under one field manager, so the API server
records which fields it owns (``metadata.managedFields``) and removes the ones it stops applying. An
object is in sync when the operator's apply entry is there and every field the operator renders has the
rendered value in the live object. Fields others add (defaults, a controller's annotations, a sidecar a
webhook injects into a keyed list) are theirs; a value someone changed (``kubectl edit`` of the image or
the args, a manual scale of a workload whose replicas the operator owns) is drift, and the next apply
takes the field back. The spec-hash annotation is one of the rendered fields: a changed rendering (a
field dropped included) always differs from the live object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mambaserve.operator.spec import quantity_bytes

# Lists the API server merges item by item on a key (listType=map): items others add are not drift.
KEYED_LISTS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
               "imagePullSecrets": "name", "volumeMounts": "mountPath"}
_METADATA = ("name", "namespace", "labels", "annotations", "ownerReferences")


def in_sync(desired: Mapping[str, Any], live: Mapping[str, Any], manager: str) -> bool:
    if apply_entry(live, manager) is None:
        return False  # created or last written by something else (an older operator's patches, kubectl)
    want = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    meta = {k: v for k, v in (desired.get("metadata") or {}).items() if k in _METADATA}
    return covers(meta, live.get("metadata") or {}) and covers(want, live)


def covers(want: Any, have: Any, field: str | None = None) -> bool:
    """Every value of ``want`` is in ``have`` (which may hold more)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(k in have and covers(v, have[k], k) for k, v in want.items())
    if isinstance(want, Sequence) and not isinstance(want, str):
        if not isinstance(have, Sequence) or isinstance(have, str):
            return False
        key = KEYED_LISTS.get(field or "")
        if key is not None and all(isinstance(i, Mapping) and key in i for i in want):
            by_key = {i.get(key): i for i in have if isinstance(i, Mapping)}
            return all(i[key] in by_key and covers(i, by_key[i[key]]) for i in want)
        return len(want) == len(have) and all(covers(w, h) for w, h in zip(want, have))
    return want == have or _same_quantity(want, have)


def _same_quantity(a: Any, b: Any) -> bool:
    """The API server writes quantities in canonical form ("0.5" cpu comes back as "500m")."""
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (str, int, float)) \
            or not isinstance(b, (str, int, float)):
        return False
    try:
        return quantity_bytes(a) == quantity_bytes(b)
    except ValueError:
        return False


def apply_entry(live: Mapping[str, Any], manager: str) -> Mapping[str, Any] | None:
    for entry in (live.get("metadata") or {}).get("managedFields") or ():
        if entry.get("manager") == manager and entry.get("operation") == "Apply" and not entry.get("subresource"):
            return entry
    return None


def owns(live: Mapping[str, Any], manager: str, path: Sequence[str]) -> bool:
    """Whether the manager's apply entry owns the field at ``path`` (map keys only), per its FieldsV1 set."""
    entry = apply_entry(live, manager)
    fields: Any = (entry or {}).get("fieldsV1")
    for key in path:
        if not isinstance(fields, Mapping) or f"f:{key}" not in fields:
            return False
        fields = fields[f"f:{key}"]
    return entry is not None
