"""Session endpoints: open and close (SGLang's names), snapshot to a file and restore from one."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from mambaserve.server.api.ownership import SECRET_HEADER, caller_of
from mambaserve.server.api.protocol import CloseSessionRequest, OpenSessionRequest, RestoreRequest, SnapshotRequest
from mambaserve.server.api.schemas import ERRORS, RestoreResult, SnapshotResult, Success
from mambaserve.server.engine.engine import Engine

SECRET_DOC = {SECRET_HEADER: {"description": "the session's secret (send it back with its turns and verbs)",
                              "schema": {"type": "string"}}}


def session_routes(engine: Engine) -> APIRouter:
    router = APIRouter(responses=ERRORS)

    @router.post("/open_session", responses={200: {"description": "the session id", "model": str,
                                                   "headers": SECRET_DOC}})
    async def open_session(body: OpenSessionRequest, request: Request, response: Response):
        caller = caller_of(request)
        sid = await engine.open_session(body.session_id, body.streaming, body.timeout, body.capacity_of_str_len,
                                        caller)
        response.headers[SECRET_HEADER] = caller.new_secret
        return sid

    @router.post("/close_session", responses={200: {"model": Success}})
    async def close_session(body: CloseSessionRequest, request: Request):
        await engine.close_session(body.session_id, caller_of(request, body.session_secret))
        return {"success": True}

    @router.post("/sessions/{session_id}/snapshot", responses={200: {"model": SnapshotResult}})
    async def snapshot_session(session_id: str, request: Request, body: SnapshotRequest | None = None):
        return await engine.snapshot_session(session_id, body.name if body else None,
                                             caller_of(request, body.session_secret if body else None))

    @router.post("/sessions/restore", responses={200: {"model": RestoreResult, "headers": SECRET_DOC}})
    async def restore_session(body: RestoreRequest, request: Request, response: Response):
        caller = caller_of(request, body.session_secret)
        result = await engine.restore_session(body.name, body.session_id, caller)
        if result.pop("new_secret", False):  # a file without an owner (an older version's): a new secret
            response.headers[SECRET_HEADER] = caller.new_secret
        return result

    return router
