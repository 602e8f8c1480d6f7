"""Response helpers shared by the endpoints: the error envelope, SSE framing, waiting for admission,
and collecting a non-streaming generation while watching for a client disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mambaserve.server.engine.request import BadRequest, FinishReason, StepOutput


class ClientGone(Exception):
    """The client disconnected before its non-streaming response was ready (answered 499)."""


def error_response(status: int, message: str, code: str = "invalid_request",
                   type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_, "code": code}})


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Last(str):
    """A stream's last events (e.g. its last chunk, the usage and ``[DONE]``): ``SSEResponse`` writes them with
    the end of the body, one write where each was one (a socket write, and h11's framing, each)."""


DONE = Last(sse("[DONE]"))


class SSEResponse(Response):
    """A streamed answer (``text/event-stream``) from an async iterator of events, each written as it comes; a
    ``Last`` ends the body with it. Starlette's StreamingResponse does the same but watches for the client's
    disconnect in an anyio task group (two tasks and cancel scopes per response, on the event loop that the
    scheduler shares the interpreter lock with); here one task waits for the disconnect and cancels the writer.
    Either way a client gone closes ``events`` (which aborts its requests) and the response ends quietly.

    With an ``admission`` the response first waits, under the same watch, for each of its generations' first
    output (``Admission``): a refusal is raised as its HTTP error (the app's exception handlers answer it, nothing
    was sent yet) and a client gone meanwhile raises ClientGone. So a handler returns as soon as it has submitted,
    and at a burst's first tokens each writer goes straight to its socket (a handler that waited itself first tore
    down its watch's two tasks, a pass of the event loop for every answer of the burst before any was written, then
    went back through the framework). ``headers`` may be a function: called once admitted (a session turn's)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | Callable[[], dict[str, str]] | None = None,
                 admission: Admission | None = None):
        self.events, self.status_code, self.background = events, 200, None
        self.admission, self.late_headers = admission, headers if callable(headers) else None
        self.init_headers(None if callable(headers) else headers)

    async def __call__(self, scope, receive, send) -> None:
        writer, gone, started = asyncio.current_task(), False, False

        async def watch():
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            writer.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            async with contextlib.aclosing(self.events) as events:
                if self.admission is not None:
                    await self.admission.wait()
                if self.late_headers is not None:
                    self.init_headers(self.late_headers())
                started = True
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                async for event in events:
                    last = isinstance(event, Last)
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": not last})
                    if last:
                        return
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            writer.uncancel()  # (the client went away: nothing more to write, nothing to report)
            if not started:
                raise ClientGone() from None
        finally:
            watcher.cancel()
            if self.admission is not None:  # a choice still running when the response ends is aborted (a client
                await self.admission.close()  # gone while the headers were written: ``events`` never began)


def _raise_refusal(first: StepOutput) -> None:
    if first.error_status is not None:
        raise BadRequest(first.error or "request refused", code=first.error_code or "refused",
                         status=first.error_status)


async def admitted(stream: AsyncIterator[StepOutput]) -> AsyncIterator[StepOutput]:
    """For a streamed response: wait for the request's first output and raise its refusal (unknown
    session, busy session, ...) as an HTTP error before the response starts; else return a stream that
    begins with it."""
    first = await stream.__anext__()
    if first.error_status is not None:
        await stream.aclose()
        _raise_refusal(first)

    async def chained():
        try:
            yield first
            if not first.finished:
                async for out in stream:
                    yield out
        finally:
            await stream.aclose()

    return chained()


class Admission:
    """A streamed answer's generations (its n choices) until each has its first output (``admitted``): its
    ``SSEResponse`` waits for them before it starts, and its events read ``streams`` (filled then, in order). One
    refusal, the response's wait cancelled (the client gone) or the response's end closes them all: the requests
    still running are aborted."""

    def __init__(self, gens: list[AsyncIterator[StepOutput]]):
        self.gens, self.streams = gens, []

    async def wait(self) -> None:
        try:
            for g in self.gens:
                self.streams.append(await admitted(g))
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Abort the generations not yet finished (the generations themselves: an admitted one's wrapper may never
        have started, and closing it would close nothing)."""
        for g in self.gens:
            await g.aclose()


async def _unless_client_goes(request: Request, work) -> None:
    """Await ``work``, or raise ClientGone (cancelling it) as soon as the client disconnects. The
    disconnect is awaited (``receive()`` until ``http.disconnect``), not polled."""

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    job, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    done: set = set()
    try:
        done, _ = await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (job, watch):
            t.cancel()
        for t in (job, watch):
            with contextlib.suppress(asyncio.CancelledError):
                await t
    if job not in done:  # (a cancelled gather need not report cancelled(): test membership, not state)
        raise ClientGone()
    job.result()


async def merged(streams: list[AsyncIterator[StepOutput]]) -> AsyncIterator[tuple[int, StepOutput]]:
    """``(choice index, output)`` from several streams as they arrive, until every one has ended.
    Closed early (the client went away), it closes them all: every choice's request is aborted."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[StepOutput]):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        finally:
            queue.put_nowait((i, None))

    if len(streams) == 1:  # (the common case: no tasks)
        async with contextlib.aclosing(streams[0]) as it:
            async for out in it:
                yield 0, out
        return
    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, out = await queue.get()
            if out is None:
                live -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for st in streams:
            await st.aclose()


async def collect(request: Request, *streams: AsyncIterator[StepOutput]) -> list[list[StepOutput]]:
    """For a non-streamed response: every generation's outputs, or ClientGone as soon as the client
    disconnects (which closes the streams: their requests are aborted and their slots freed).

    The watch covers the whole wait, admission included (a non-streamed request's first output is its
    last), and the disconnect is awaited (``receive()`` until ``http.disconnect``), not polled. A
    refusal is raised as its HTTP error."""
    outs: list[list[StepOutput]] = [[] for _ in streams]

    async def consume(i: int, stream: AsyncIterator[StepOutput]):
        async with contextlib.aclosing(stream) as it:
            async for out in it:
                outs[i].append(out)

    await _unless_client_goes(request, asyncio.gather(*(consume(i, st) for i, st in enumerate(streams))))
    for o in outs:
        _raise_refusal(o[0])
    return outs


def ended_early(last: StepOutput) -> JSONResponse:
    """The error answer of a non-streamed OpenAI request that ended without its answer: 504 when it ran
    past --request-timeout, else 500 (the server log has the details)."""
    if last.error_code == "request_timeout":
        return error_response(504, last.error, last.error_code, "timeout_error")
    return error_response(500, last.error, last.error_code or "internal_error", "server_error")


def finish_info(out: StepOutput) -> dict | None:
    if out.finish_reason is None:
        return None
    info: dict = {"type": out.finish_reason.value}
    if out.finish_reason is FinishReason.STOP and out.matched_stop is not None:
        info["matched"] = out.matched_stop
    if out.error:
        info["message"] = out.error
    return info
