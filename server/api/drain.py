"""Drain on SIGTERM (or Ctrl-C): the server leaves without cutting an answer or losing a session.

1. It turns unready at once: ``/health`` answers 503 ``draining`` (readiness probes and the router's health
   check stop sending it work), and a new request gets 503 ``draining`` with ``Retry-After`` (a router
   retries it on another worker). Liveness (``/health?stuck_step_timeout=``), ``/metrics``, GETs and
   ``/abort_request`` / ``/close_session`` still answer. The listening socket stays open meanwhile, so
   callers get an answer, not a refused connection.
2. The requests in flight (streams included) run to their end, for at most ``--drain-timeout`` seconds
   from the signal.
3. Every open session whose record on storage is behind it (``--session-persist``) is written.
4. It exits 0. A second signal, or the deadline, ends it at once; the log says what was cut.

The progress is logged ("draining: N requests in flight ...") and ``mambaserve_drain_seconds`` counts it.
Before the model has loaded, a signal stops the server at once (nothing to drain).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

from mambaserve.server.api.connections import GuardedServer

log = logging.getLogger("mambaserve.drain")

RETRY_AFTER_S = 1
PROGRESS_EVERY_S = 5.0
# answered while draining: they end work or start none
ALLOWED = frozenset({"/abort_request", "/close_session"})
UNCOUNTED = frozenset({"/health", "/metrics"})  # a probe or a scrape does not hold the exit


class Drain:
    """The drain's state and its ASGI middleware (which counts the requests in flight)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.started: float | None = None  # time.monotonic() of the signal
        self.in_flight = 0  # HTTP requests being answered (probes and scrapes aside)
        self.on_refuse: Callable[[], None] = lambda: None

    @property
    def deadline(self) -> float:
        return self.started + self.timeout

    def middleware(self, app):
        async def drained(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            path = scope["path"]
            if self.started is not None and self._refused(scope, path):
                if path != "/health":
                    self.on_refuse()
                return await _refuse(send, path == "/health")
            if path in UNCOUNTED:
                return await app(scope, receive, send)
            self.in_flight += 1
            try:
                await app(scope, receive, send)
            finally:
                self.in_flight -= 1
        return drained

    @staticmethod
    def _refused(scope, path: str) -> bool:
        if path == "/health":  # readiness; liveness (with stuck_step_timeout) still answers
            return b"stuck_step_timeout" not in scope.get("query_string", b"")
        return scope["method"] not in ("GET", "HEAD") and path not in ALLOWED

    async def run(self, engine) -> None:
        """Wait for the requests in flight, then have the engine write the sessions behind; logs its progress.
        (The caller bounds it by the deadline.)"""
        log.info("draining: %d requests in flight, %d sessions open; new requests get 503 (--drain-timeout %g s)",
                 self.in_flight, await engine.session_count(), self.timeout)
        next_log = self.started + PROGRESS_EVERY_S
        while self.in_flight:
            await asyncio.sleep(0.05)
            engine.metrics.drain_seconds.set(time.monotonic() - self.started)
            if time.monotonic() >= next_log:
                next_log += PROGRESS_EVERY_S
                log.info("draining: %d requests in flight, %.0f s left", self.in_flight,
                         self.deadline - time.monotonic())
        written, left = await engine.persist_sessions()
        if written or left:
            log.info("draining: %d sessions written to storage%s", written,
                     f"; not persisted: {_ids(left)}" if left else "")
        log.info("drained in %.1f s: exiting", time.monotonic() - self.started)

    def cut(self, why: str) -> None:
        if self.in_flight:
            log.warning("draining: %s: exiting with %d requests in flight (their clients get a cut answer; their "
                        "sessions continue from their last answered turn)", why, self.in_flight)
        else:
            log.warning("draining: %s while sessions were being written: exiting (those not written continue "
                        "from their last written turn)", why)


def _ids(ids: list[str], shown: int = 8) -> str:
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return ", ".join(ids[:shown]) + more


async def _refuse(send, health: bool) -> None:
    message = "the server is draining (it is stopping); " + ("not ready" if health else "retry on another server")
    body = json.dumps({"error": {"message": message, "type": "server_error", "code": "draining"}}).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode())]})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(GuardedServer):
    """uvicorn's server (with the connection guard's loop handler) whose first SIGTERM / SIGINT drains
    (``Drain``) instead of stopping, and which exits 0 afterwards (uvicorn re-raises the signal it caught
    once it has stopped, which ends the process by that signal). ``engine()``: the engine once loaded."""

    def __init__(self, config, drain: Drain, engine: Callable[[], object | None]):
        super().__init__(config)
        self.drain, self.engine = drain, engine
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        engine = self.engine()
        if self.drain.started is None and engine is not None and self.loop is not None and not self.should_exit:
            self.drain.started = time.monotonic()
            self.drain.on_refuse = lambda: engine.metrics.rejected.labels("draining").inc()
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain(engine)))
            return
        if self.should_exit:  # stopping already: one more signal stops waiting for anything
            self.force_exit = True
        elif self.drain.started is not None:
            self.drain.cut("a second signal")
        self._exit_now()

    async def _drain(self, engine) -> None:
        try:
            await asyncio.wait_for(self.drain.run(engine), max(0.0, self.drain.deadline - time.monotonic()))
            self.should_exit = True  # (nothing in flight: uvicorn's graceful wait is short)
        except TimeoutError:
            self.drain.cut(f"the drain timeout ({self.drain.timeout:g} s) passed")
            self._exit_now()
        except Exception:  # noqa: BLE001 - the server must still exit
            log.exception("draining failed; exiting")
            self._exit_now()
        finally:
            engine.metrics.drain_seconds.set(time.monotonic() - self.drain.started)

    def _exit_now(self) -> None:
        """Stop now: the connections are closed, so what is in flight ends as a client's disconnect does (its
        request aborted; uvicorn would cancel it with a traceback each); the engine still stops, its storage
        writes reaching the disk."""
        for connection in list(self.server_state.connections):
            connection.transport.close()
        self.config.timeout_graceful_shutdown = min(self.config.timeout_graceful_shutdown or 0.5, 0.5)
        self.should_exit = True
