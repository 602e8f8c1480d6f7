"""Fixtures: the real Kopf operator against kmock's in-memory Kubernetes API emulator.

The emulator serves discovery, list, watch, create, patch (merge and JSON patch) and delete with
finalizers. It has no garbage collector, admission, defaulting, metadata.generation or scale
subresource logic; the tests do what those parts of a real API server would do where it matters
(they set uid/generation on the objects they create and bump generation on spec changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import pathlib
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import aiohttp.web
import jsonpatch
import kmock
import pytest
import pytest_asyncio
import yaml
from kmock._internal import dicts as kmock_dicts

from tests.operator import ssa

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
SAMPLES = CRDS / "samples"
DATA = pathlib.Path(__file__).resolve().parent / "data"

class VersionedEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the API-server behaviour the operator and Kopf depend on:

    - every write moves ``metadata.resourceVersion`` (Kopf compares it to skip watch events older than
      its own last patch; with a constant version it would re-run creation handlers on stale events);
    - server-side apply (``application/apply-patch+yaml``) and field ownership in ``managedFields``
      (tests/operator/ssa.py), and an apply that changes nothing writes nothing (no new version, no event);
    - a failed JSON-patch ``test`` is a 422 (Kopf's optimistic-concurrency guard), not a 500;
    - a write refused with ``refuse`` changes nothing. kmock stores every write before its reactions
      answer, so a ``<< Response(status=422)`` on a PATCH still created the object: the next reconcile
      found it in place and cleared the Degraded condition the refusal had set.
    """

    _versions = itertools.count(2)

    def refuse(self, method: str, path: str, status: int, reason: str, message: str) -> None:
        """Answer every ``method path`` request with this error, as an API server refusing the object does."""
        self.__dict__.setdefault("_refused", {})[method.upper(), path] = (status, reason, message)

    async def _handle(self, request: Any) -> Any:
        refused = self.__dict__.get("_refused", {}).get((request.method.value, request.url.path))
        if refused is not None:
            status, reason, message = refused
            raise kmock.KubernetesError(status=status, reason=reason, message=message)
        if request.resource is None or request.method not in ("POST", "PATCH"):
            return await super()._handle(request)
        version = str(next(self._versions))
        manager = request.params.get("fieldManager") or request.headers.get("User-Agent", "unknown").split("/")[0]
        if request.method == "POST":
            if isinstance(request.data, dict):
                request.data.setdefault("metadata", {})["resourceVersion"] = version
                ssa.update(None, request.data, manager)
            return await super()._handle(request)
        key = (request.resource, request.namespace, request.name)
        stored = self._objects[key] if key in self._objects else None
        live = None if stored is None or stored.deleted else copy.deepcopy(stored.raw)
        if request.subresource is not None or (live is None and "apply-patch" not in request.headers.get(
                "Content-Type", "")):
            if isinstance(request.data, dict):  # status and scale: only the version moves
                request.data.setdefault("metadata", {})["resourceVersion"] = version
            elif isinstance(request.data, list):
                request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
            return await super()._handle(request)
        if "apply-patch" in request.headers.get("Content-Type", ""):
            try:
                new = ssa.apply(live, request.data, manager, force=request.params.get("force") == "true")
            except ssa.Conflict as e:
                raise kmock.KubernetesError(status=409, reason="Conflict", message=str(e)) from None
            if live is None:  # apply creates; the write below then adds nothing (reactions still answer)
                await self._create_applied(request, key, new, version)
                object.__setattr__(request, "data", {})
                return await super()._handle(request)
            if _without_times(new) == _without_times(live):
                return aiohttp.web.json_response(live)
        else:
            patched = jsonpatch.apply_patch(live, request.data) if isinstance(request.data, list) \
                else kmock_dicts.merge_patch_dict(live, request.data)
            new = ssa.update(live, copy.deepcopy(dict(patched)), manager)
        new["metadata"]["resourceVersion"] = version
        object.__setattr__(request, "data", _merge_diff(live, new))
        return await super()._handle(request)

    async def _create_applied(self, request: Any, key: Any, obj: dict[str, Any], version: str) -> None:
        meta = obj["metadata"]
        meta.update({"resourceVersion": version, "generation": 1, "creationTimestamp": "2025-01-01T00:00:00Z"})
        if request.namespace:
            meta["namespace"] = request.namespace
        meta.setdefault("uid", f"uid-{next(_uids)}")
        async with self._lock:
            if key in self._objects:
                self._objects[key].create(obj)
            else:
                self._objects[key] = obj
            await self._buses[request.resource].put({"type": "ADDED", "object": self._objects[key].raw})

    async def _render_error(self, exc: Exception) -> Any:
        if isinstance(exc, jsonpatch.JsonPatchTestFailed):
            exc = kmock.KubernetesError(status=422, reason="Invalid", message=str(exc))
        return await super()._render_error(exc)


def _without_times(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    for entry in out.get("metadata", {}).get("managedFields") or ():
        entry.pop("time", None)
    return out


def _merge_diff(old: Any, new: Any) -> Any:
    """The JSON merge patch that turns ``old`` into ``new`` (kmock stores every write as a merge)."""
    out = {}
    for key in old.keys() - new.keys():
        out[key] = None
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(old.get(key), dict):
            sub = _merge_diff(old[key], value)
            if sub:
                out[key] = sub
        elif key not in old or old[key] != value:
            out[key] = value
    return out


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": VersionedEmulator}


_ALL_VERBS = ["get", "list", "watch", "create", "patch", "delete"]
# (resource key, kind, namespaced, subresources)
EMULATED = [
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, []),
    ("v1/namespaces", "Namespace", False, []),
    ("v1/events", "Event", True, []),
    ("v1/pods", "Pod", True, []),
    ("v1/configmaps", "ConfigMap", True, []),
    ("v1/services", "Service", True, []),
    ("v1/serviceaccounts", "ServiceAccount", True, []),
    ("v1/persistentvolumeclaims", "PersistentVolumeClaim", True, ["status"]),
    ("apps/v1/deployments", "Deployment", True, ["status", "scale"]),
    ("apps/v1/statefulsets", "StatefulSet", True, ["status", "scale"]),
    ("batch/v1/jobs", "Job", True, ["status"]),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, ["status"]),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, []),
    ("autoscaling/v2/horizontalpodautoscalers", "HorizontalPodAutoscaler", True, ["status"]),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True, []),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True, []),
    ("coordination.k8s.io/v1/leases", "Lease", True, []),
    ("mambaserve.io/v1alpha1/inferencesessions", "InferenceSession", True, ["status", "scale"]),
    ("mambaserve.io/v1alpha1/cachetiers", "CacheTier", True, ["status"]),
]
OPTIONAL = {
    "keda": ("keda.sh/v1alpha1/scaledobjects", "ScaledObject", True, ["status"]),
    "monitoring": ("monitoring.coreos.com/v1/servicemonitors", "ServiceMonitor", True, []),
    "podmonitors": ("monitoring.coreos.com/v1/podmonitors", "PodMonitor", True, []),
}

RESOURCE_OF = {kind: key for key, kind, _, _ in EMULATED + list(OPTIONAL.values())}


def load_yaml(path: pathlib.Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_crd(name: str) -> dict[str, Any]:
    return load_yaml(CRDS / f"mambaserve.io_{name}.yaml")


def sample(name: str) -> dict[str, Any]:
    return load_yaml(SAMPLES / f"{name}.yaml")


_uids = itertools.count(1)


class Cluster:
    """Test-side view of the emulator: write objects like kubectl would, read what the operator did."""

    def __init__(self, kmock: Any) -> None:
        self.kmock = kmock
        self.url = str(kmock.url).rstrip("/")

    @staticmethod
    def _client() -> aiohttp.ClientSession:
        # A session per call: kmock's own client is closed when an operator run in-process stops (Kopf's
        # shutdown). The user agent marks the requests as this test's (kubectl's role), as kmock's does.
        return aiohttp.ClientSession(headers={"User-Agent": "kmock/cluster"})

    def key(self, kind: str) -> str:
        return RESOURCE_OF[kind]

    def path(self, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        key = self.key(kind)
        group_version, plural = key.rsplit("/", 1)
        base = f"/api/{group_version}" if group_version == "v1" else f"/apis/{group_version}"
        p = f"{base}/namespaces/{namespace}/{plural}"
        return p + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "llm")
        meta.setdefault("uid", f"uid-{next(_uids)}")
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp", "2025-01-01T00:00:00Z")
        async with self._client() as client, client.post(self.url + self.path(obj["kind"], meta["namespace"]),
                                                         json=obj) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def create_cluster_scoped(self, obj: dict[str, Any]) -> dict[str, Any]:
        group_version, plural = self.key(obj["kind"]).rsplit("/", 1)
        async with self._client() as client, client.post(f"{self.url}/apis/{group_version}/{plural}", json=obj) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def patch(self, kind: str, name: str, patch: dict[str, Any], namespace: str = "llm",
                    sub: str | None = None, manager: str = "kubectl-edit") -> None:
        async with self._client() as client, client.patch(
                self.url + self.path(kind, namespace, name, sub), json=patch, params={"fieldManager": manager},
                headers={"Content-Type": "application/merge-patch+json"}) as resp:
            assert resp.status == 200, await resp.text()

    async def update_spec(self, kind: str, name: str, spec_patch: dict[str, Any], namespace: str = "llm") -> None:
        """A spec change as the API server records it: the patch plus a generation bump."""
        generation = (self.get(kind, name, namespace) or {})["metadata"].get("generation", 1)
        await self.patch(kind, name, {"spec": spec_patch, "metadata": {"generation": generation + 1}}, namespace)

    async def delete(self, kind: str, name: str, namespace: str = "llm") -> None:
        async with self._client() as client, client.delete(self.url + self.path(kind, namespace, name)) as resp:
            assert resp.status == 200, await resp.text()

    def _object(self, kind: str, name: str, namespace: str) -> Any:
        for (resource, ns, n), obj in self.kmock.objects.items():
            if n == name and ns == namespace and _same(resource, self.key(kind)):
                return obj
        return None

    def get(self, kind: str, name: str, namespace: str = "llm") -> dict[str, Any] | None:
        obj = self._object(kind, name, namespace)
        return None if obj is None or obj.deleted else copy.deepcopy(obj.raw)

    def names(self, kind: str, namespace: str = "llm") -> set[str]:
        return {name for (resource, ns, name), obj in self.kmock.objects.items()
                if ns == namespace and not obj.deleted and _same(resource, self.key(kind))}

    def versions(self, kind: str, name: str, namespace: str = "llm") -> int:
        """How many versions the emulator stored: every create and patch adds one."""
        obj = self._object(kind, name, namespace)
        return 0 if obj is None else len(obj.history)

    def writes(self) -> list[tuple[str, str]]:
        """Every object-changing request the emulator has seen (method, path)."""
        return [(r.method, r.url.path) for r in self.kmock if r.method in ("POST", "PATCH", "DELETE")]

    def condition(self, kind: str, name: str, type_: str) -> dict[str, Any] | None:
        obj = self.get(kind, name) or {}
        for cond in (obj.get("status") or {}).get("conditions") or ():
            if cond["type"] == type_:
                return cond
        return None


def _same(resource: Any, key: str) -> bool:
    group_version, plural = key.rsplit("/", 1)
    group, _, version = group_version.rpartition("/")
    return resource.group == group and resource.version == version and resource.plural == plural


async def eventually(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll until ``check()`` returns a truthy value (returned) or fail with the last result."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (KeyError, TypeError, AttributeError) as e:
            last = e
        if last and not isinstance(last, Exception):
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not reached within {timeout}s; last result: {last!r}")


def register_resources(kmock: Any, optional: tuple[str, ...] = ("keda", "monitoring", "podmonitors")) -> None:
    for key, kind, namespaced, subresources in EMULATED + [OPTIONAL[o] for o in optional]:
        kmock.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=_ALL_VERBS,
                                                  subresources=subresources)


@pytest.fixture
def cluster(kmock: Any) -> Cluster:
    register_resources(kmock)
    return Cluster(kmock)


class RunningOperator:
    def __init__(self, task: asyncio.Task[None], stop: asyncio.Event, metrics: Any) -> None:
        self.task, self.stop_flag, self.metrics = task, stop, metrics

    async def stop(self) -> None:
        # Cancelling (rather than the stop flag) skips Kopf's 5-second grace for "hung" tasks,
        # which here are only the emulator's open watch streams.
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@pytest_asyncio.fixture
async def start_operator(cluster: Cluster) -> Any:
    """Start the real operator (Kopf + handlers) in-process against the emulator."""
    from mambaserve.operator.__main__ import run
    from mambaserve.operator.metrics import OperatorMetrics
    from mambaserve.operator.settings import OperatorSettings

    running: list[RunningOperator] = []

    async def start(**overrides: Any) -> RunningOperator:
        settings = OperatorSettings(**{"api_server": cluster.url, "status_interval": 0.3, "metrics_timeout": 0.5,
                                       "tier_retry_delay": 0.3, "metrics_port": 0, "health_port": 0, **overrides})
        stop = asyncio.Event()
        metrics = OperatorMetrics()
        task = asyncio.create_task(run(settings, stop_flag=stop, metrics=metrics))
        op = RunningOperator(task, stop, metrics)
        running.append(op)
        return op

    yield start
    for op in running:
        if not op.task.done():
            await op.stop()
