"""Watch streams that keep a local copy of the objects the operator reads (a reflector, as client-go's).

One ``Informer`` per kind (and per watched namespace, or one for all): a LIST, then a WATCH from the list's
resourceVersion, resumed from the last version seen when the server ends the stream (``timeoutSeconds``)
and re-listed when the server says the version is too old (410 Gone). Children are listed and watched
by the label every object the operator creates carries, so the streams carry only those. ``Kube.get`` and
``Kube.list`` answer from these copies: a session at rest costs the API server no request at all, where
each status tick used to read every child (about 30 GETs and LISTs per session every 15 s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp

log = logging.getLogger("mambaserve.operator.watches")

Key = tuple[str | None, str]  # (namespace, name)
# A kind the cluster does not serve (KEDA, prometheus-operator) is looked for again this often.
MISSING_RECHECK = 300.0
MAX_BACKOFF = 30.0


@dataclasses.dataclass(frozen=True)
class Timeouts:
    server: float = 300.0  # the API server ends each watch after this (timeoutSeconds)
    client: float = 330.0  # no byte for this long: the connection is taken for dead


class Gone(Exception):
    """The resourceVersion to resume from is too old (410): list again."""


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace"), meta["name"]


def newer_or_same(obj: Mapping[str, Any], than: Mapping[str, Any] | None) -> bool:
    """Whether ``obj`` is at least as new as ``than`` (resourceVersions compared as numbers where they are:
    etcd revisions; an opaque one is taken as newer)."""
    if than is None:
        return True
    a = (obj.get("metadata") or {}).get("resourceVersion")
    b = (than.get("metadata") or {}).get("resourceVersion")
    try:
        return int(a) >= int(b)
    except (TypeError, ValueError):
        return True


class Informer:
    """The objects of one kind in one namespace (None: all), kept current by LIST + WATCH."""

    def __init__(self, request: Callable[..., Awaitable[Any]], stream: Callable[..., Any], url: str,
                 labels: str | None, matches: Callable[[Mapping[str, Any]], bool], timeouts: Timeouts) -> None:
        self._request, self._stream, self._url = request, stream, url
        self._labels, self._matches, self._timeouts = labels, matches, timeouts
        self.objects: dict[Key, dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self.missing = False  # the kind is not served
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"watch {self._url}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def store(self, obj: Mapping[str, Any]) -> None:
        """An object the operator just wrote, as the API server answered it (the watch may lag behind)."""
        key = key_of(obj)
        if self._matches(obj) and newer_or_same(obj, self.objects.get(key)):
            self.objects[key] = dict(obj)

    async def _run(self) -> None:
        from mambaserve.operator.kube import ResourceNotInstalled  # kube imports this module

        backoff = 1.0
        while True:
            try:
                version = await self._list()
                backoff = 1.0
                while True:
                    version = await self._watch(version)
            except asyncio.CancelledError:
                raise
            except ResourceNotInstalled:
                self.missing = True
                self.objects.clear()
                self.synced.set()
                await asyncio.sleep(MISSING_RECHECK)
            except Gone:
                continue
            except Exception as e:  # noqa: BLE001 - a broken stream is re-listed, never fatal
                log.warning("watch of %s failed (%s); listing again in %.0f s", self._url, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF)

    async def _list(self) -> str | None:
        params = {"labelSelector": self._labels} if self._labels else {}
        result = await self._request("GET", self._url, params=params) or {}
        self.objects = {key_of(i): i for i in result.get("items") or () if self._matches(i)}
        self.missing = False
        self.synced.set()
        return (result.get("metadata") or {}).get("resourceVersion")

    async def _watch(self, version: str | None) -> str | None:
        """Apply the events of one watch request; the version to resume from when the server ends it."""
        params = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(int(self._timeouts.server))}
        if version:
            params["resourceVersion"] = version
        if self._labels:
            params["labelSelector"] = self._labels
        async for event in self._stream(self._url, params, self._timeouts.client):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise Gone(obj.get("message"))
                raise RuntimeError(f"watch error: {obj.get('message')}")
            version = (obj.get("metadata") or {}).get("resourceVersion") or version
            if kind == "BOOKMARK":
                continue
            key = key_of(obj)
            if kind == "DELETED" or not self._matches(obj):
                self.objects.pop(key, None)
            elif newer_or_same(obj, self.objects.get(key)):
                self.objects[key] = obj
        return version


async def json_lines(response: aiohttp.ClientResponse) -> Any:
    """The events of a watch response, one JSON object per line."""
    async for line in response.content:
        line = line.strip()
        if line:
            yield json.loads(line)
