"""Response helpers shared by the endpoints: the error envelope, SSE framing, waiting for admission,
and collecting a non-streaming generation while watching for a client disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from mambaserve.server.engine.request import BadRequest, FinishReason, StepOutput


class ClientGone(Exception):
    """The client disconnected before its non-streaming response was ready (answered 499)."""


def error_response(status: int, message: str, code: str = "invalid_request",
                   type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_, "code": code}})


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


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

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(asyncio.gather(*(consume(i, st) for i, st in enumerate(streams))))
    watch = asyncio.ensure_future(disconnected())
    done: set = set()
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            t.cancel()
        for t in (work, watch):
            with contextlib.suppress(asyncio.CancelledError):
                await t
    if work not in done:  # (a cancelled gather need not report cancelled(): test membership, not state)
        raise ClientGone()
    work.result()
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
