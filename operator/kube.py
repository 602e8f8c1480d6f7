"""The one module that talks to the Kubernetes API (Kopf's own watching and events aside).

``apply`` is server-side apply under the operator's field manager, sent only when the live object is not
in sync with the desired one (``drift.py``: the operator's managed fields present and every rendered value
in place), so a restarted operator produces no writes and a ``kubectl edit`` of a rendered field is undone.
The API server keeps fields other controllers own and removes those the operator stops rendering.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
import kopf

from mambaserve.operator import drift, names, watches
from mambaserve.operator.settings import FIELD_MANAGER, GROUP, VERSION

# Owns a workload's replicas between the operator letting go of them and the autoscaler's first write.
HANDOVER_MANAGER = f"{FIELD_MANAGER}-handover"


@dataclasses.dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True


KINDS: dict[str, Kind] = {k.kind: k for k in (
    Kind("v1", "ConfigMap", "configmaps"),
    Kind("v1", "Service", "services"),
    Kind("v1", "ServiceAccount", "serviceaccounts"),
    Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
    Kind("v1", "Pod", "pods"),
    Kind("apps/v1", "Deployment", "deployments"),
    Kind("apps/v1", "StatefulSet", "statefulsets"),
    Kind("batch/v1", "Job", "jobs"),
    Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
    Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
    Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
    Kind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors"),
    Kind("monitoring.coreos.com/v1", "PodMonitor", "podmonitors"),
    Kind("coordination.k8s.io/v1", "Lease", "leases"),
    Kind("apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", namespaced=False),
    Kind(f"{GROUP}/{VERSION}", "InferenceSession", "inferencesessions"),
    Kind(f"{GROUP}/{VERSION}", "CacheTier", "cachetiers"),
)}

# Kinds an InferenceSession may own; stale ones are pruned by label and owner uid.
SESSION_CHILD_KINDS = ("ConfigMap", "Service", "Deployment", "StatefulSet", "PodDisruptionBudget", "NetworkPolicy",
                       "HorizontalPodAutoscaler", "ScaledObject", "ServiceMonitor",
                       "ServiceAccount", "Role", "RoleBinding", "Job", "PersistentVolumeClaim")



class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def invalid(self) -> bool:
        """The API server refused the object itself; retrying the same object cannot help."""
        return self.status in (400, 422)


class ResourceNotInstalled(ApiError):
    """The kind is not served (e.g. KEDA or prometheus-operator CRDs absent)."""


@dataclasses.dataclass(frozen=True)
class Applied:
    kind: str
    name: str
    action: str  # created | patched | unchanged | recreated


def matches(labels: Mapping[str, str] | None, selector: Mapping[str, str]) -> bool:
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)


def credentials(logger: Any, settings: kopf.OperatorSettings | None = None,
                **kwargs: Any) -> kopf.ConnectionInfo | None:
    """Kubernetes credentials as Kopf finds them: the official client library where it is installed
    (every kubeconfig, exec plugins included), else the pod's ServiceAccount, else a plain kubeconfig.
    The operator image leaves the client library out (128 MB; images/operator.Dockerfile)."""
    settings = settings if settings is not None else kopf.OperatorSettings()
    return (kopf.login_via_client(logger=logger, settings=settings, **kwargs)
            or kopf.login_with_service_account(logger=logger, settings=settings, **kwargs)
            or kopf.login_with_kubeconfig(logger=logger, settings=settings, **kwargs))


def command_line_credentials(api_server: str | None, logger: Any) -> kopf.ConnectionInfo:
    """For the operator's one-shot commands (hooks): ``--api-server`` (development, no credentials), else
    ``credentials``; exits with a sentence when there are none."""
    if api_server:
        return kopf.ConnectionInfo(server=api_server, insecure=True)
    info = credentials(logger)
    if info is None:
        raise SystemExit("no Kubernetes credentials: no ServiceAccount token, no kubeconfig")
    return info


class Kube:
    """Async client over one connection (from Kopf's login), renewed when credentials change.

    With ``watch(kinds, ...)`` reads of those kinds are answered from watch streams (watches.py) instead
    of requests; every other read, and every write, is a request."""

    def __init__(self, connection: kopf.ConnectionInfo | None = None, *, timeout: float = 60.0,
                 agent: str = FIELD_MANAGER) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._agent = agent  # the User-Agent: audit logs tell the replicas apart
        self._connection: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()
        self._watched: dict[str, Mapping[str, str] | None] = {}  # kind -> label selector of its stream
        self._watch_namespaces: tuple[str, ...] = ()
        self._watch_timeouts = watches.Timeouts()
        self._informers: dict[tuple[str, str | None], watches.Informer] = {}
        if connection is not None:
            self._connection = connection

    def watch(self, kinds: Mapping[str, Mapping[str, str] | None], namespaces: Iterable[str] = (),
              timeouts: watches.Timeouts = watches.Timeouts()) -> None:
        """Answer reads of these kinds (kind -> the label selector of its stream, or None for all objects)
        from watch streams over ``namespaces`` (empty: all), each started at its first read."""
        self._watched, self._watch_namespaces, self._watch_timeouts = dict(kinds), tuple(namespaces), timeouts

    def login(self, connection: kopf.ConnectionInfo) -> None:
        if connection != self._connection:
            self._connection = connection
            old, self._session = self._session, None
            if old is not None:
                asyncio.ensure_future(old.close())

    async def close(self) -> None:
        for informer in self._informers.values():
            await informer.stop()
        self._informers.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _client(self) -> aiohttp.ClientSession:
        async with self._lock:
            if self._session is None or self._session.closed:
                if self._connection is None:
                    raise RuntimeError("no Kubernetes credentials yet (the login handler has not run)")
                self._session = _make_session(self._connection, self._timeout, self._agent)
            return self._session

    @property
    def server(self) -> str:
        assert self._connection is not None
        return self._connection.server.rstrip("/")

    # --- URLs ---------------------------------------------------------------------------------

    def _url(self, kind: str, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        k = KINDS[kind]
        base = f"/api/{k.api_version}" if "/" not in k.api_version else f"/apis/{k.api_version}"
        path = base + (f"/namespaces/{namespace}" if k.namespaced and namespace else "") + f"/{k.plural}"
        if name:
            path += f"/{name}"
        if sub:
            path += f"/{sub}"
        return self.server + path

    async def _request(self, method: str, url: str, *, body: Any = None, content_type: str | None = None,
                       params: Mapping[str, str] | None = None) -> Any:
        client = await self._client()
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
            data = json.dumps(body)
        async with client.request(method, url, data=data, headers=headers, params=params) as response:
            text = await response.text()
            if response.status >= 400:
                try:
                    status = json.loads(text)
                except ValueError:
                    status = {}
                reason = status.get("reason") or response.reason or ""
                message = status.get("message") or text[:500]
                if response.status == 404 and _resource_missing(reason, status.get("details")):
                    raise ResourceNotInstalled(404, reason, message)
                raise ApiError(response.status, reason, message)
            return json.loads(text) if text else None

    async def _stream(self, url: str, params: Mapping[str, str], idle: float) -> Any:
        """The events of one watch request (no total timeout: ``idle`` seconds without a byte end it)."""
        client = await self._client()
        timeout = aiohttp.ClientTimeout(total=None, sock_read=idle)
        async with client.get(url, params=params, headers={"Accept": "application/json"}, timeout=timeout) as response:
            if response.status >= 400:
                text = await response.text()
                status = json.loads(text) if text.startswith("{") else {}
                if response.status == 404 and _resource_missing(status.get("reason") or "", status.get("details")):
                    raise ResourceNotInstalled(404, status.get("reason") or "", status.get("message") or text)
                if response.status == 410:
                    raise watches.Gone(status.get("message"))
                raise ApiError(response.status, status.get("reason") or "", status.get("message") or text[:500])
            async for event in watches.json_lines(response):
                yield event

    async def _informer(self, kind: str, namespace: str | None) -> watches.Informer | None:
        """The synced informer that holds ``kind`` in ``namespace``, or None when reads go to the API server."""
        if kind not in self._watched or (self._watch_namespaces and namespace not in self._watch_namespaces):
            return None
        scope = namespace if self._watch_namespaces else None
        informer = self._informers.get((kind, scope))
        if informer is None:
            labels = self._watched[kind]
            informer = watches.Informer(
                self._request, self._stream, self._url(kind, scope),
                names.selector_string(labels) if labels else None,
                lambda obj: not labels or matches((obj.get("metadata") or {}).get("labels"), labels),
                self._watch_timeouts)
            self._informers[kind, scope] = informer
            informer.start()
        await asyncio.wait_for(informer.synced.wait(), self._timeout.total)
        if informer.missing:
            raise ResourceNotInstalled(404, "NotFound", f"the cluster does not serve {kind}")
        return informer

    def _remember(self, obj: Any) -> None:
        """Write-through: what a write returned is in the local copy before its watch event arrives."""
        if isinstance(obj, Mapping) and obj.get("kind") in KINDS:
            namespace = (obj.get("metadata") or {}).get("namespace")
            informer = self._informers.get((obj["kind"], namespace if self._watch_namespaces else None))
            if informer is not None:
                informer.store(obj)

    # --- reads --------------------------------------------------------------------------------

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None. From the watch streams where the kind is watched (do not modify it)."""
        informer = await self._informer(kind, namespace)
        if informer is not None:
            return informer.objects.get((namespace, name))
        try:
            return await self._request("GET", self._url(kind, namespace, name))
        except ResourceNotInstalled:
            raise
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str | None,
                   labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        informer = await self._informer(kind, namespace)
        if informer is not None:
            items = [o for (ns, _), o in informer.objects.items() if namespace is None or ns == namespace]
        else:
            params = {"labelSelector": names.selector_string(labels)} if labels else None
            result = await self._request("GET", self._url(kind, namespace), params=params)
            items = list((result or {}).get("items") or [])
        # Filter here too: it costs nothing and keeps the contract when a server ignores the selector.
        return [i for i in items if not labels or matches((i.get("metadata") or {}).get("labels"), labels)]

    # --- writes -------------------------------------------------------------------------------

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        result = await self._request("POST", self._url(obj["kind"], meta.get("namespace")), body=obj,
                                     params={"fieldManager": FIELD_MANAGER})
        self._remember(result)
        return result

    async def delete(self, kind: str, namespace: str | None, name: str, orphan: bool = False) -> bool:
        try:
            await self._request("DELETE", self._url(kind, namespace, name),
                                body={"kind": "DeleteOptions", "apiVersion": "v1",
                                      "propagationPolicy": "Orphan" if orphan else "Background"})
            return True
        except ResourceNotInstalled:
            return False
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    async def json_patch(self, kind: str, namespace: str | None, name: str, ops: list[dict[str, Any]],
                         sub: str | None = None) -> dict[str, Any]:
        return await self._request("PATCH", self._url(kind, namespace, name, sub), body=ops,
                                   content_type="application/json-patch+json",
                                   params={"fieldManager": FIELD_MANAGER})

    async def merge_patch(self, kind: str, namespace: str | None, name: str, patch: Mapping[str, Any],
                          sub: str | None = None) -> dict[str, Any]:
        result = await self._request("PATCH", self._url(kind, namespace, name, sub), body=patch,
                                     content_type="application/merge-patch+json",
                                     params={"fieldManager": FIELD_MANAGER})
        self._remember(result)
        return result

    async def patch_status(self, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        await self.merge_patch(kind, namespace, name, {"status": status}, sub="status")

    async def server_side_apply(self, obj: Mapping[str, Any], manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """Server-side apply: the API server merges ``obj`` into the object (creating it when missing), records
        the fields as ``manager``'s and removes those the manager applied before but leaves out now. ``force``
        takes back fields someone else changed meanwhile (their edit is the drift being undone)."""
        meta = obj["metadata"]
        result = await self._request("PATCH", self._url(obj["kind"], meta.get("namespace"), meta["name"]), body=obj,
                                     content_type="application/apply-patch+yaml",
                                     params={"fieldManager": manager, "force": "true"})
        self._remember(result)
        return result

    async def apply(self, desired: Mapping[str, Any]) -> Applied:
        """Desired state by server-side apply, only when the live object is not already it (drift.in_sync)."""
        kind, meta = desired["kind"], desired["metadata"]
        namespace, name = meta.get("namespace"), meta["name"]
        live = await self.get(kind, namespace, name)
        if live is None:
            await self.server_side_apply(desired)
            return Applied(kind, name, "created")
        live_annotations = (live.get("metadata") or {}).get("annotations") or {}
        want = meta.get("annotations") or {}
        if names.IMMUTABLE_HASH in want and live_annotations.get(names.IMMUTABLE_HASH) != want[names.IMMUTABLE_HASH]:
            return await self._replace(desired)
        if drift.in_sync(desired, live, FIELD_MANAGER):
            return Applied(kind, name, "unchanged")
        await self._hand_over_replicas(desired, live)
        await self.server_side_apply(desired)
        return Applied(kind, name, "patched")

    async def _replace(self, desired: Mapping[str, Any]) -> Applied:
        """A new object for parts the API server never lets change (a StatefulSet's claim templates, a Job)."""
        kind, namespace, name = desired["kind"], desired["metadata"].get("namespace"), desired["metadata"]["name"]
        if kind == "PersistentVolumeClaim":
            raise ApiError(422, "Immutable", f"claim {name} exists with a different spec (size, class or "
                                             "access mode): delete it to have it re-created with the new one")
        # A StatefulSet's pods are orphaned, not deleted: they keep serving, and the new StatefulSet (same
        # name, selector and ordinals) adopts them and rolls them onto its template one at a time.
        await self.delete(kind, namespace, name, orphan=kind == "StatefulSet")
        await self._wait_gone(kind, namespace, name)
        await self.server_side_apply(desired)
        return Applied(kind, name, "recreated")

    async def _hand_over_replicas(self, desired: Mapping[str, Any], live: Mapping[str, Any]) -> None:
        """When an autoscaler takes a workload's replicas over, the operator stops applying the field; applied
        as is, the API server would remove it (back to 1 replica). A second manager applies the live count first
        and keeps owning it until the autoscaler writes it (the documented server-side apply handover)."""
        if desired["kind"] in ("Deployment", "StatefulSet") and "replicas" not in (desired.get("spec") or {}) \
                and drift.owns(live, FIELD_MANAGER, ("spec", "replicas")):
            meta = desired["metadata"]
            await self.server_side_apply({"apiVersion": desired["apiVersion"], "kind": desired["kind"],
                                          "metadata": {"name": meta["name"], "namespace": meta.get("namespace")},
                                          "spec": {"replicas": (live.get("spec") or {}).get("replicas", 1)}},
                                         manager=HANDOVER_MANAGER)

    async def _wait_gone(self, kind: str, namespace: str | None, name: str, timeout: float = 30.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while await self.get(kind, namespace, name) is not None:
            if asyncio.get_running_loop().time() > deadline:
                raise kopf.TemporaryError(f"{kind} {name} is still being deleted", delay=10)
            await asyncio.sleep(0.2)

    async def prune(self, kinds: Iterable[str], namespace: str, labels: Mapping[str, str], owner_uid: str,
                    keep: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Delete objects of these kinds that carry the labels and the owner, except ``keep``."""
        keep_set, deleted = set(keep), []
        for kind in kinds:
            try:
                items = await self.list(kind, namespace, labels)
            except ResourceNotInstalled:
                continue
            for item in items:
                name = item["metadata"]["name"]
                if (kind, name) in keep_set or not owned_by(item, owner_uid):
                    continue
                if await self.delete(kind, namespace, name):
                    deleted.append((kind, name))
        return deleted


def _resource_missing(reason: str, details: Any) -> bool:
    """A 404 for the kind itself rather than for one object of it.

    A real API server names the object in ``details`` when only the object is missing and leaves
    the details empty for an unknown resource; the emulator used in tests says so in its reason.
    """
    if "Resource" in reason:
        return True
    return reason == "NotFound" and not (isinstance(details, Mapping) and details.get("name"))


def _make_session(info: kopf.ConnectionInfo, timeout: aiohttp.ClientTimeout, agent: str) -> aiohttp.ClientSession:
    headers: dict[str, str] = {"User-Agent": agent}
    auth = None
    if info.token:
        headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
    elif info.username and info.password:
        auth = aiohttp.BasicAuth(info.username, info.password)
    context: ssl.SSLContext | bool
    if info.insecure:
        context = False
    else:
        cadata = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
        context = ssl.create_default_context(cafile=info.ca_path or None, cadata=cadata or None)
        if info.certificate_path and info.private_key_path:
            context.load_cert_chain(info.certificate_path, info.private_key_path)
        elif info.certificate_data and info.private_key_data:
            context = _cert_from_data(context, info.certificate_data, info.private_key_data)
    connector = aiohttp.TCPConnector(ssl=context, limit=20)
    return aiohttp.ClientSession(headers=headers, auth=auth, connector=connector, timeout=timeout)


def _cert_from_data(context: ssl.SSLContext, cert: str | bytes, key: str | bytes) -> ssl.SSLContext:
    # ssl only loads client certificates from files: write them to private temporary files.
    import os
    import tempfile
    paths = []
    for data in (cert, key):
        fd, path = tempfile.mkstemp(prefix="mambaserve-operator-")
        with os.fdopen(fd, "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())
        paths.append(path)
    try:
        context.load_cert_chain(paths[0], paths[1])
    finally:
        for path in paths:
            os.unlink(path)
    return context
