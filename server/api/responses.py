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


async def admitted(stream: AsyncIterator[StepOutput]) -> AsyncIterator[StepOutput]:
    """Wait for the request's first output: raise its refusal as an HTTP error (unknown session,
    busy session, ...) before any response starts; else return a stream that begins with it."""
    first = await stream.__anext__()
    if first.error_status is not None:
        await stream.aclose()
        raise BadRequest(first.error or "request refused", code=first.error_code or "refused",
                         status=first.error_status)

    async def chained():
        try:
            yield first
            if not first.finished:
                async for out in stream:
                    yield out
        finally:
            await stream.aclose()

    return chained()


async def collect(request: Request, stream: AsyncIterator[StepOutput]) -> list[StepOutput]:
    """Consume a generation for a non-streaming response, aborting it if the client disconnects."""
    outs: list[StepOutput] = []

    async def consume():
        async with contextlib.aclosing(stream) as it:
            async for out in it:
                outs.append(out)

    task = asyncio.ensure_future(consume())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()  # closes the stream, which aborts the request and frees its slot
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone()
    task.result()
    return outs


def finish_info(out: StepOutput) -> dict | None:
    if out.finish_reason is None:
        return None
    info: dict = {"type": out.finish_reason.value}
    if out.finish_reason is FinishReason.STOP and out.matched_stop is not None:
        info["matched"] = out.matched_stop
    if out.error:
        info["message"] = out.error
    return info
