"""Kubernetes RBAC authorization of API requests against rendered (Cluster)Roles and bindings.

Used to enforce the chart's RBAC inside kmock's emulator (which has no authorizer of its own):
requests the rendered rules do not allow get 403 Forbidden, as a real API server would answer.
Follows the API server's request-to-attributes mapping: GET on a collection is `list` (`watch`
with ?watch=true), GET on an object `get`, POST `create`, PATCH `patch`, PUT `update`, DELETE
`delete`; `/status` and `/scale` are subresources (`inferencesessions/status`). Discovery paths
(/api, /apis, /apis/<group>/<version>) are non-resource URLs every authenticated user may read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Access:
    verb: str
    group: str
    resource: str  # with "/<subresource>" when there is one
    namespace: str | None
    name: str | None

    def __str__(self) -> str:
        where = f" in {self.namespace}" if self.namespace else " (cluster)"
        return f"{self.verb} {self.group or 'core'}/{self.resource}{where}"


_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def access_of(method: str, path: str, params: Mapping[str, str]) -> Access | None:
    """The RBAC attributes of a request, or None for a non-resource (discovery) URL."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"]:
        group, rest = (parts[1] if len(parts) > 1 else ""), parts[3:]
    else:
        return None
    if not rest:
        return None  # /api, /api/v1, /apis, /apis/<group>/<version>: discovery
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)
    if method == "GET":
        verb = "get" if name else ("watch" if str(params.get("watch", "")).lower() in ("1", "true") else "list")
    elif method == "DELETE" and not name:
        verb = "deletecollection"
    else:
        verb = _VERBS[method]
    return Access(verb, group, f"{resource}/{sub}" if sub else resource, namespace, name)


def _rule_allows(rule: Mapping[str, Any], access: Access) -> bool:
    def has(values: Iterable[str], value: str) -> bool:
        values = list(values or [])
        return "*" in values or value in values
    if "resourceNames" in rule and access.name not in rule["resourceNames"]:
        return False
    return has(rule.get("apiGroups"), access.group) and has(rule.get("resources"), access.resource) \
        and has(rule.get("verbs"), access.verb)


class Authorizer:
    """What one ServiceAccount may do according to a set of rendered RBAC objects."""

    def __init__(self, objects: Iterable[Mapping[str, Any]], account: str, account_namespace: str) -> None:
        objects = list(objects)
        roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o.get("rules") or []
                 for o in objects if o["kind"] in ("Role", "ClusterRole")}
        self.grants: list[tuple[str | None, Mapping[str, Any]]] = []  # (namespace or None for all, rule)
        for binding in objects:
            if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            if not any(s.get("kind") == "ServiceAccount" and s.get("name") == account
                       and s.get("namespace") == account_namespace for s in binding.get("subjects") or ()):
                continue
            ref = binding["roleRef"]
            scope = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
            role_ns = scope if ref["kind"] == "Role" else None
            rules = roles.get((ref["kind"], role_ns, ref["name"]))
            assert rules is not None, f"{binding['kind']} {binding['metadata']['name']} refers to a missing {ref}"
            self.grants += [(scope, rule) for rule in rules]

    def allows(self, access: Access) -> bool:
        for scope, rule in self.grants:
            # A RoleBinding grants only inside its namespace, never cluster-scoped or all-namespace access.
            if scope is not None and access.namespace != scope:
                continue
            if _rule_allows(rule, access):
                return True
        return False

    def granted(self) -> set[tuple[str, str, str]]:
        """Every (group, resource, verb) the rules name."""
        return {(g, r, v) for _, rule in self.grants for g in rule["apiGroups"] for r in rule["resources"]
                for v in rule["verbs"]}


def owner_reference_accesses(body: Any, namespace: str | None) -> list[Access]:
    """What OpenShift's OwnerReferencesPermissionEnforcement admission plugin checks on a write:
    an owner reference with ``blockOwnerDeletion: true`` needs ``update`` on the owner's
    ``finalizers`` subresource (owners here are the operator's own kinds, named by plural)."""
    if isinstance(body, list):  # a JSON patch: the values it writes
        values = [op.get("value") for op in body if isinstance(op, Mapping)]
        refs = [r for v in values if isinstance(v, list) for r in v if isinstance(r, Mapping) and "uid" in r]
    elif isinstance(body, Mapping):
        refs = list(((body.get("metadata") or {}).get("ownerReferences")) or [])
    else:
        refs = []
    out = []
    for ref in refs:
        if not ref.get("blockOwnerDeletion"):
            continue
        group = ref["apiVersion"].rpartition("/")[0]
        plural = ref["kind"].lower() + "s"
        out.append(Access("update", group, f"{plural}/finalizers", namespace, ref.get("name")))
    return out
