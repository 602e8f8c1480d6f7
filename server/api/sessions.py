"""Session endpoints: open and close (SGLang's names), snapshot to a file and restore from one."""

from __future__ import annotations

from fastapi import APIRouter

from mambaserve.server.api.protocol import CloseSessionRequest, OpenSessionRequest, RestoreRequest, SnapshotRequest
from mambaserve.server.api.schemas import ERRORS, RestoreResult, SnapshotResult, Success
from mambaserve.server.engine.engine import Engine


def session_routes(engine: Engine) -> APIRouter:
    router = APIRouter(responses=ERRORS)

    @router.post("/open_session", responses={200: {"description": "the session id", "model": str}})
    async def open_session(body: OpenSessionRequest):
        return await engine.open_session(body.session_id, body.streaming, body.timeout, body.capacity_of_str_len)

    @router.post("/close_session", responses={200: {"model": Success}})
    async def close_session(body: CloseSessionRequest):
        await engine.close_session(body.session_id)
        return {"success": True}

    @router.post("/sessions/{session_id}/snapshot", responses={200: {"model": SnapshotResult}})
    async def snapshot_session(session_id: str, body: SnapshotRequest | None = None):
        return await engine.snapshot_session(session_id, body.name if body else None)

    @router.post("/sessions/restore", responses={200: {"model": RestoreResult}})
    async def restore_session(body: RestoreRequest):
        return await engine.restore_session(body.name, body.session_id)

    return router
