"""Connection hygiene at the HTTP edge: read deadlines, a connection limit, a bounded accept-error log.

What uvicorn leaves open (measured, issue 33): its keep-alive timeout runs only between requests, so a
connection that sends half a request line, half its headers or half its body (or nothing at all) is
held for good; 1,800 such connections stayed open, and under a 1,024-descriptor limit they made every
new request time out while asyncio's accept loop logged a traceback per refused accept (356 MB of log
in a minute). Here:

* ``ConnectionGuard.protocol()``: uvicorn's HTTP protocol (httptools where installed, else h11) with one
  deadline per request: its headers must be complete ``header_timeout`` seconds after its first byte (or
  after the connection opened), its body ``body_timeout`` seconds after the headers. Past it the client
  gets 408 (when no answer has started) and the connection is closed. Idle keep-alive connections keep
  uvicorn's own timeout.
* ``ConnectionGuard.middleware()``: past ``max_connections`` open connections, a request is answered 503
  with ``Retry-After`` and its connection closed (a connection opened past the limit has a second to
  send its headers), so the server keeps serving those it has instead of running out of descriptors.
* ``GuardedEventLoop`` and ``AcceptErrorLog``: out of descriptors, one failed ``accept()`` and one
  retry per second instead of thousands, logged once per interval with a count, no traceback.
* ``raise_descriptor_limit``: the soft descriptor limit raised to the hard one (containerd 2 starts
  containers at 1,024 soft), and ``default_max_connections`` derived from it.

The same protocol counts a generation request as arriving from its headers until it is submitted or
answered (``ConnectionGuard.arrivals``): an idle scheduler holds its step for those (``policy.burst_hold``).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import time

import uvicorn

from mambaserve.server.api.timing import ARRIVAL, GENERATION_PATHS
from mambaserve.server.engine.timeline import Arrivals, Timeline

log = logging.getLogger(__name__)

RESERVED_DESCRIPTORS = 1 / 4  # of the limit, kept for files, pipes and connections past the limit
MAX_CONNECTIONS_CAP = 4096
MAX_DESCRIPTORS = 2**20  # the soft limit is raised this far at most (Linux's default nr_open)
OVER_LIMIT_GRACE_S = 1.0  # a connection opened past the limit: seconds to send its headers (then 503)


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_DESCRIPTORS if hard == resource.RLIM_INFINITY else min(hard, MAX_DESCRIPTORS)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, e)
    return MAX_DESCRIPTORS if soft == resource.RLIM_INFINITY else soft


def default_max_connections(descriptor_limit: int) -> int:
    """Three quarters of the descriptor limit, at most 4,096: past the limit connections get 503 and still
    hold a descriptor until answered, so a quarter stays for them and for the server's own files."""
    return max(8, min(MAX_CONNECTIONS_CAP, int(descriptor_limit * (1 - RESERVED_DESCRIPTORS))))


def _error_response(status: str, message: str, code: str, headers: tuple[tuple[bytes, bytes], ...] = ()):
    """An error answer with ``connection: close``, as ASGI ``(start, body)`` messages."""
    kind = "server_error" if status.startswith("5") else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers,
            (b"connection", b"close")]
    return head, body


def _raw(status: str, message: str, code: str, headers=()) -> bytes:
    """The same answer as bytes, written straight to a transport (for a request that never reached the app)."""
    head, body = _error_response(status, message, code, headers)
    return (f"HTTP/1.1 {status}\r\n".encode() + b"".join(k + b": " + v + b"\r\n" for k, v in head) + b"\r\n"
            + body)


RETRY = ((b"retry-after", b"1"),)


class ConnectionGuard:
    """The limits of one server's connections and what they refused (read by ``/metrics``)."""

    def __init__(self, max_connections: int, header_timeout: float, body_timeout: float):
        self.max_connections, self.header_timeout, self.body_timeout = max_connections, header_timeout, body_timeout
        self.refused = {"header_timeout": 0, "body_timeout": 0, "too_many_connections": 0}
        self.arrivals = Arrivals()  # generation requests received and not yet submitted (the engine reads it)
        self.open = lambda: 0  # set once the server exists: its open connections

    def over_limit(self) -> str:
        return (f"the server has more than {self.max_connections} open connections (--max-connections); "
                "retry shortly")

    def protocol(self) -> type:
        """uvicorn's HTTP protocol (``default_parser``'s) with these deadlines (``http=`` of ``uvicorn.Config``)."""
        base = _HTTP_PROTOCOLS[default_parser()]()
        return type(f"Guarded{base.__name__}", (_Guarded, base), {"guard": self})

    def middleware(self, app):
        return ConnectionLimit(app, self)


def _h11() -> type:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


def _httptools() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


_HTTP_PROTOCOLS = {"h11": _h11, "httptools": _httptools}


def default_parser() -> str:
    """``MAMBASERVE_HTTP`` (``h11`` or ``httptools``) where set, else httptools (llhttp, in C) where it is installed,
    as uvicorn itself chooses: the event loop's time per request and per streamed chunk was 3-19% less than with
    h11's pure-Python parsing and framing (benchmarks/http_overhead.py)."""
    chosen = os.environ.get("MAMBASERVE_HTTP")
    if chosen:
        if chosen not in _HTTP_PROTOCOLS:
            raise ValueError(f"MAMBASERVE_HTTP={chosen!r}: one of {', '.join(_HTTP_PROTOCOLS)}")
        return chosen
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


class _Guarded:
    """Mixed into either of uvicorn's HTTP protocols (the same cycle and connection attributes). One deadline at a
    time: a request's headers (from its first byte, or from the connection's opening), then its body (from the
    headers). A connection opened past the limit has ``OVER_LIMIT_GRACE_S`` for its headers, then gets its 503
    anyway: it holds a descriptor while it waits."""

    guard: ConnectionGuard
    _deadline: asyncio.TimerHandle | None = None
    _over_limit = False
    _arrival: Timeline | None = None  # the timeline of the request this connection is answering

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._over_limit = len(self.connections) > self.guard.max_connections
        self._arm_headers()  # a connection that never sends a byte is half-sent too

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        if self._deadline is None and (before is None or before.response_complete):
            self._arm_headers()  # the first byte of the next request on this connection
        super().data_received(data)
        cycle = self.cycle
        if cycle is not None and cycle is not before:
            self._count_arrival(cycle.scope)
        if cycle is not None and cycle is not before and cycle.more_body:
            self._arm(self.guard.body_timeout, "body")  # the headers are in; the body has its own deadline
        elif cycle is not None and not cycle.more_body and not cycle.response_complete:
            self._disarm()  # the whole request has arrived

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._settle()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._disarm()  # an answer sent before its body arrived (413, 401): the connection closes anyway
        self._settle()
        super().on_response_complete()

    def _count_arrival(self, scope: dict) -> None:
        """A generation request's headers are in: counted as arriving (``timeline.Arrivals``) from now, before
        the app's task for it runs, so that a scheduler looking at the count sees the whole of a burst whose
        bytes came in together, not only the requests the event loop has taken into the app so far."""
        if scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
            self._arrival = scope[ARRIVAL] = self.guard.arrivals.arrived()

    def _settle(self) -> None:
        if self._arrival is not None:
            self._arrival.settle()
            self._arrival = None

    def _arm_headers(self) -> None:
        self._arm(min(OVER_LIMIT_GRACE_S, self.guard.header_timeout) if self._over_limit
                  else self.guard.header_timeout, "header")

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, what, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, what: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        answering = cycle is not None and not cycle.response_complete
        if not (answering and cycle.response_started):
            if self._over_limit and what == "header":
                self.guard.refused["too_many_connections"] += 1
                answer = _raw("503 Service Unavailable", self.guard.over_limit(), "too_many_connections", RETRY)
            else:
                self.guard.refused[f"{what}_timeout"] += 1
                answer = _raw("408 Request Timeout", f"the request's {what} did not arrive within {seconds:g} s",
                              "request_read_timeout")
            self.transport.write(answer)
        if answering:  # the app waits for the body: it sees a disconnect, and nothing it sends goes out
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


class ConnectionLimit:
    """ASGI middleware: 503 with ``Retry-After`` and ``connection: close`` for a request that arrives while
    more than the limit's connections are open (its own counted)."""

    def __init__(self, app, guard: ConnectionGuard):
        self.app, self.guard = app, guard

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.guard.open() <= self.guard.max_connections:
            return await self.app(scope, receive, send)
        self.guard.refused["too_many_connections"] += 1
        head, body = _error_response("503", self.guard.over_limit(), "too_many_connections", RETRY)
        await send({"type": "http.response.start", "status": 503, "headers": head})
        await send({"type": "http.response.body", "body": body})


class AcceptErrorLog:
    """An event loop exception handler: accept() failures (EMFILE, ENFILE, ENOBUFS, ENOMEM; asyncio retries
    the accept a second later) are logged once per ``interval`` seconds with how many there were."""

    def __init__(self, interval: float = 10.0, clock=time.monotonic):
        self.interval, self.clock = interval, clock
        self.count, self.logged_at, self.last = 0, float("-inf"), ""

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and "accept" in context.get("message", "")):
            return loop.default_exception_handler(context)
        self.count += 1
        self.last = exc.strerror or str(exc)
        now = self.clock()
        if now - self.logged_at >= self.interval:
            log.error("cannot accept connections: %s (%d times since the last report; open-file limit %d): "
                      "new connections wait in the backlog", self.last, self.count,
                      resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            self.count, self.logged_at = 0, now


RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class _AcceptOnce:
    """A listening socket whose ``accept`` reports "nothing more to accept" after its first resource error."""

    def __init__(self, sock):
        self._sock, self._failed = sock, False

    def accept(self):
        if self._failed:
            raise BlockingIOError
        try:
            return self._sock.accept()
        except OSError as e:
            self._failed = e.errno in RESOURCE_ERRORS
            raise

    def __getattr__(self, name):
        return getattr(self._sock, name)


class GuardedEventLoop(asyncio.SelectorEventLoop):
    """asyncio's selector loop, whose accept loop stops at the first resource error. asyncio accepts up to
    ``backlog`` (2,048) connections per wake-up and, on EMFILE, logs, schedules a retry a second later and
    goes on accepting: each wake-up while out of descriptors scheduled 2,048 retries, which piled up and
    spun the loop (170,000 accept errors in 10 s, requests starved). With this, one error and one retry
    per second; what waits stays in the kernel's backlog. (uvicorn: ``loop="<this module>:GuardedEventLoop"``.)"""

    def _accept_connection(self, protocol_factory, sock, *args, **kwargs):
        sock = getattr(sock, "_sock", sock)  # the retry asyncio schedules passes the wrapper back
        return super()._accept_connection(protocol_factory, _AcceptOnce(sock), *args, **kwargs)


class GuardedServer(uvicorn.Server):
    """uvicorn's server with ``AcceptErrorLog`` as its event loop's exception handler."""

    async def startup(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        await super().startup(sockets)
