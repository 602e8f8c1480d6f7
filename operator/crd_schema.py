"""What the API server does with a custom resource before storing it, offline.

1. defaulting from the structural schema (``default:``),
2. OpenAPI v3 validation (jsonschema, with the Kubernetes extensions translated; unknown fields are
   errors, as with kubectl's default strict field validation),
3. every ``x-kubernetes-validations`` rule evaluated by a real CEL implementation (cel-python) with
   ``self`` bound to the node, and ``oldSelf`` for transition rules on updates.

It covers the rules' semantics, not the API server's CEL cost budget. ``mambaserve-operator render``
checks its input with it; the tests check the CRDs and samples with it. The running operator never
needs it (the API server has already done all of this), so jsonschema and cel-python are imported here only.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import celpy
import jsonschema

_MISSING = object()


def version_schema(crd: Mapping[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for name in list(value):
                value[name] = apply_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def to_jsonschema(schema: Mapping[str, Any], root: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key in ("description", "default"):
            continue
        if key == "properties":
            out[key] = {name: to_jsonschema(sub, root=False) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, Mapping):
            out[key] = to_jsonschema(value, root=False)
        else:
            out[key] = value
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("type") == "object" and "properties" in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if root and "metadata" in out.get("properties", {}):
        out["properties"]["metadata"] = {"type": "object"}
    return out


_env = celpy.Environment()
_programs: dict[str, Any] = {}


def cel_program(rule: str) -> Any:
    if rule not in _programs:
        _programs[rule] = _env.program(_env.compile(rule))
    return _programs[rule]


def _cel_errors(schema: Mapping[str, Any], value: Any, old: Any, path: str) -> list[str]:
    errors = []
    for v in schema.get("x-kubernetes-validations") or ():
        rule = v["rule"]
        transition = "oldSelf" in rule
        if transition and old is _MISSING:
            continue  # transition rules run on updates only, where the old value exists
        activation = {"self": celpy.json_to_cel(value)}
        if transition:
            activation["oldSelf"] = celpy.json_to_cel(old)
        result = cel_program(rule).evaluate(activation)
        if isinstance(result, Exception) or result is not True and result != celpy.celtypes.BoolType(True):
            # The API server reports a rule at its fieldPath (relative to the node) when it has one.
            where = (path + v.get("fieldPath", "")).lstrip(".")
            errors.append(f"{where or '<root>'}: {v.get('message', rule)}")
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                old_sub = old.get(name, _MISSING) if isinstance(old, dict) else _MISSING
                errors += _cel_errors(sub, value[name], old_sub, f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        # Kubernetes correlates list items for oldSelf only in map/set lists; ours have none with rules.
        for i, item in enumerate(value):
            errors += _cel_errors(schema["items"], item, _MISSING, f"{path}[{i}]")
    return errors


def admit(crd: Mapping[str, Any], obj: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> tuple[dict, list[str]]:
    """(the object as stored, errors); an empty error list means the API server would accept it."""
    schema = version_schema(crd)
    stored = apply_defaults(schema, copy.deepcopy(dict(obj)))
    old_stored = apply_defaults(schema, copy.deepcopy(dict(old))) if old is not None else _MISSING
    validator = jsonschema.Draft7Validator(to_jsonschema(schema))
    errors = [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
              for e in validator.iter_errors(stored)]
    if not errors:
        errors = _cel_errors(schema, stored, old_stored, "")
    return stored, errors


def all_rules(schema: Mapping[str, Any]) -> list[str]:
    rules = [v["rule"] for v in schema.get("x-kubernetes-validations") or ()]
    for sub in (schema.get("properties") or {}).values():
        rules += all_rules(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), Mapping):
            rules += all_rules(schema[key])
    return rules


def structural_problems(schema: Mapping[str, Any], path: str = "") -> list[str]:
    """The structural-schema rules the API server enforces on CRDs (the ones that bite in practice)."""
    problems = []
    untyped_ok = schema.get("x-kubernetes-int-or-string") or schema.get("x-kubernetes-preserve-unknown-fields")
    if "type" not in schema and not untyped_ok:
        problems.append(f"{path or '<root>'}: missing type")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{path}: properties and additionalProperties together")
    if schema.get("x-kubernetes-list-type") == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        required = set(schema["items"].get("required") or [])
        if not keys or not set(keys) <= required:
            problems.append(f"{path}: list-map keys must be required item fields")
    for name, sub in (schema.get("properties") or {}).items():
        problems += structural_problems(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), Mapping):
            problems += structural_problems(schema[key], f"{path}[]")
    return problems
