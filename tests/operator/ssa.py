"""Field ownership as the API server keeps it (``metadata.managedFields``), for the test emulator.

Simplified from Kubernetes' structured-merge-diff: a field set is the set of paths to leaves, where every
list is one leaf (atomic; the real server merges keyed lists item by item), metadata counts only labels,
annotations and ownerReferences, and status is not tracked. What it keeps of the real semantics, and
what the operator relies on:

- apply (``application/apply-patch+yaml``) merges the applied object in, records its paths as the
  manager's ``Apply`` entry, and removes fields the manager applied before but leaves out now, unless
  another manager owns them too; a field another manager changed is a conflict (409) unless ``force``,
  which takes it over;
- any other write (create, merge or JSON patch) gives the writer the fields it changed, taken from
  whoever owned them (an ``Update`` entry: how ``kubectl edit`` takes the image from the operator).
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Mapping
from typing import Any

Path = tuple[str, ...]
_TRACKED_METADATA = ("labels", "annotations")


def field_paths(obj: Mapping[str, Any]) -> set[Path]:
    out: set[Path] = set()

    def walk(value: Any, path: Path) -> None:
        if isinstance(value, Mapping) and value:
            for key, sub in value.items():
                walk(sub, (*path, key))
        else:
            out.add(path)

    for key, value in obj.items():
        if key in ("apiVersion", "kind", "status"):
            continue
        if key == "metadata":
            for sub in _TRACKED_METADATA:
                for name in (value.get(sub) or {}):
                    out.add(("metadata", sub, name))
            if value.get("ownerReferences"):
                out.add(("metadata", "ownerReferences"))
            continue
        walk(value, (key,))
    return out


def get(obj: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


_MISSING = object()


def remove(obj: dict[str, Any], path: Path) -> None:
    parents = [obj]
    for key in path[:-1]:
        nxt = parents[-1].get(key)
        if not isinstance(nxt, dict):
            return
        parents.append(nxt)
    parents[-1].pop(path[-1], None)
    for parent, key in zip(reversed(parents[:-1]), reversed(path[:-1])):  # drop maps left empty
        if parent.get(key) == {} and key != "metadata":
            del parent[key]


def merge(base: Any, applied: Any) -> Any:
    if isinstance(base, Mapping) and isinstance(applied, Mapping):
        out = dict(base)
        for key, value in applied.items():
            out[key] = merge(base.get(key), value) if key in base else copy.deepcopy(value)
        return out
    return copy.deepcopy(applied)


def to_fields_v1(paths: set[Path]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for path in sorted(paths):
        node = root
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return root


def from_fields_v1(fields: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    children = {k[2:]: v for k, v in fields.items() if k.startswith("f:")}
    if not children and prefix:
        out.add(prefix)
    for key, sub in children.items():
        out |= from_fields_v1(sub, (*prefix, key))
    return out


def _entries(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [dict(e) for e in (obj.get("metadata") or {}).get("managedFields") or ()]


def _with_entries(obj: dict[str, Any], owned: dict[tuple[str, str], set[Path]], api_version: str) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    obj.setdefault("metadata", {})["managedFields"] = [
        {"manager": manager, "operation": operation, "apiVersion": api_version, "time": now,
         "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(paths)}
        for (manager, operation), paths in owned.items() if paths]
    return obj


def _owned(obj: Mapping[str, Any]) -> dict[tuple[str, str], set[Path]]:
    return {(e["manager"], e["operation"]): from_fields_v1(e.get("fieldsV1") or {}) for e in _entries(obj)}


class Conflict(Exception):
    def __init__(self, paths: list[tuple[str, Path]]) -> None:
        super().__init__("; ".join(f"conflict with {m!r}: .{'.'.join(p)}" for m, p in paths))


def apply(live: Mapping[str, Any] | None, applied: Mapping[str, Any], manager: str, force: bool) -> dict[str, Any]:
    """The object after ``manager`` applies ``applied`` (``live`` None: it is created)."""
    applied = {k: v for k, v in applied.items() if k != "status"}
    new_paths = field_paths(applied)
    if live is None:
        return _with_entries(copy.deepcopy(dict(applied)), {(manager, "Apply"): new_paths}, applied["apiVersion"])
    owned = _owned(live)
    mine = (manager, "Apply")
    conflicts = [(m, p) for (m, op), paths in owned.items() if (m, op) != mine
                 for p in paths & new_paths if get(live, p) != get(applied, p)]
    if conflicts and not force:
        raise Conflict(conflicts)
    for key, paths in owned.items():
        if key != mine:
            paths -= {p for _, p in conflicts}
    result = copy.deepcopy(dict(live))
    others = set().union(*(paths for key, paths in owned.items() if key != mine)) if owned else set()
    for path in owned.get(mine, set()) - new_paths - others:
        remove(result, path)
    result = merge(result, applied)
    owned[mine] = new_paths
    return _with_entries(result, owned, applied["apiVersion"])


def update(old: Mapping[str, Any] | None, new: dict[str, Any], manager: str) -> dict[str, Any]:
    """``new`` (written by ``manager`` with a create or a patch) with the ownership the write gives it."""
    owned = _owned(old) if old is not None else {}
    before = field_paths(old) if old is not None else set()
    after = field_paths(new)
    changed = {p for p in after if old is None or get(old, p) != get(new, p)}
    gone = before - after
    for paths in owned.values():
        paths -= changed | gone
    owned.setdefault((manager, "Update"), set()).update(changed)
    return _with_entries(new, owned, new.get("apiVersion", "v1"))
