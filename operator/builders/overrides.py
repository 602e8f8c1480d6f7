"""``spec.podTemplate``: the user's pod template merged over the one the operator renders, last.

The merge follows ``kubectl patch``'s strategic merge where it matters for a pod: maps merge key by
key, lists of named things merge item by item on the same key the Kubernetes API declares for them
(containers by ``name``, volume mounts by ``mountPath``, ...), and every other list or scalar is
replaced. ``null`` removes a key; ``{"name": X, "$patch": "delete"}`` removes item ``X`` from a
keyed list (both as in a strategic merge patch). Pure functions over plain dicts.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

# Field name -> the key its list items merge on (the API's patchMergeKey for these fields).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "resourceClaims": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
    "topologySpreadConstraints": "topologyKey",
    "hostAliases": "ip",
}
_DIRECTIVE = "$patch"


def merge(base: Any, override: Any, field: str | None = None) -> Any:
    """``override`` merged over ``base`` (neither is modified)."""
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        out = copy.deepcopy(dict(base))
        for key, value in override.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge(out[key], value, key)
            else:
                out[key] = _clean(value)
        return out
    if isinstance(base, list) and isinstance(override, list) and field in MERGE_KEYS:
        return _merge_keyed(base, override, MERGE_KEYS[field])
    return _clean(override)


def _merge_keyed(base: list[Any], override: list[Any], key: str) -> list[Any]:
    out = copy.deepcopy(base)
    for item in override:
        if not isinstance(item, Mapping) or key not in item:
            raise ValueError(f"every item of a list merged by {key!r} needs a {key!r}: {item!r}")
        at = next((i for i, have in enumerate(out) if isinstance(have, Mapping) and have.get(key) == item[key]), None)
        if item.get(_DIRECTIVE) == "delete":
            if at is not None:
                del out[at]
        elif at is None:
            out.append(_clean(item))
        else:
            out[at] = merge(out[at], item)
    return out


def _clean(value: Any) -> Any:
    """A value taken as is from the override, without patch directives or null members."""
    if isinstance(value, Mapping):
        return {k: _clean(v) for k, v in value.items() if v is not None and k != _DIRECTIVE}
    if isinstance(value, list):
        return [_clean(v) for v in value if not (isinstance(v, Mapping) and v.get(_DIRECTIVE) == "delete")]
    return copy.deepcopy(value)


def apply_pod_template(template: Mapping[str, Any], override: Mapping[str, Any] | None,
                       owned_labels: Mapping[str, str]) -> dict[str, Any]:
    """The rendered pod template with the user's ``podTemplate`` merged over it.

    Labels the operator selects pods by keep the operator's values: a changed selector label would
    orphan the pods (the CRD refuses such labels; this is the second line).
    """
    if not override:
        return copy.deepcopy(dict(template))
    merged = merge(template, {"metadata": override.get("metadata") or {}, "spec": override.get("spec") or {}})
    merged.setdefault("metadata", {}).setdefault("labels", {}).update(owned_labels)
    return merged
