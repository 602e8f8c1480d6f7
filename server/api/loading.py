"""Serve while the model loads: the port is bound at once and every request gets 503 ``loading``
(``/health`` included, so probes and routers wait) until the engine is ready; then the real app takes
over. A load that fails stops the server with the reason.

Loading a multi-GB checkpoint and capturing CUDA graphs takes minutes; binding first lets the
orchestrator see a live process with an honest 503 instead of a refused connection.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Awaitable, Callable



class LoadingApp:
    """ASGI app wrapping ``load`` (run on a worker thread at startup; returns ``(engine, app)``)."""

    def __init__(self, load: Callable[[], tuple[object, object]], on_ready: Callable[[object], None] = lambda e: None,
                 on_failure: Callable[[BaseException], None] = lambda e: None,
                 warm_up: Callable[[object, object], Awaitable[None]] | None = None):
        """``warm_up(app, engine)``: awaited once the engine runs, before the app takes over (still 503);
        ``on_ready(engine)``: called after it, the last thing before the app takes over."""
        self._load, self._on_ready, self._on_failure, self._warm_up = load, on_ready, on_failure, warm_up
        self.engine = self.app = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        body = json.dumps({"error": {"message": "the model is loading; retry shortly", "type": "server_error",
                                     "code": "loading"}}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", b"5")]})
        await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive, send):
        await receive()  # lifespan.startup
        loop = asyncio.get_running_loop()
        loading = loop.create_future()

        def run():
            try:
                result = self._load()
            except BaseException as e:  # noqa: BLE001 - reported through on_failure
                loop.call_soon_threadsafe(loading.set_exception, e)
            else:
                loop.call_soon_threadsafe(loading.set_result, result)

        # a daemon thread: stopping the server during a minutes-long load must not wait for it
        threading.Thread(target=run, name="model-load", daemon=True).start()
        loading.add_done_callback(self._loaded)
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        if self.engine is not None:
            self.engine.stop()
        await send({"type": "lifespan.shutdown.complete"})

    def _loaded(self, future: asyncio.Future) -> None:
        if future.cancelled():
            return
        if future.exception() is not None:
            self._on_failure(future.exception())
            return
        engine, app = future.result()
        engine.start()
        self.engine = engine  # stopped at shutdown from here on
        if self._warm_up is None:
            self._ready(app)
        else:
            asyncio.ensure_future(self._warm_up(app, engine)).add_done_callback(lambda f: self._warmed(f, app))

    def _warmed(self, future: asyncio.Future, app) -> None:
        if future.cancelled():
            return
        if future.exception() is not None:
            self._on_failure(future.exception())
        else:
            self._ready(app)

    def _ready(self, app) -> None:
        self.engine.mark_ready()  # kernels that compile from here on made a request wait: counted and logged
        self._on_ready(self.engine)  # before the app takes over: nothing it does makes a request wait
        self.app = app
