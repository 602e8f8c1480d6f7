"""FastAPI app: error handling, health, metrics, and the SGLang-native endpoints.

OpenAI endpoints live in ``openai_api``. Handlers never block: they hand work to the engine's
scheduler thread and await its increments.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mambaserve.server.engine.engine import Engine
from mambaserve.server.api.protocol import (AbortRequest, CloseSessionRequest, GenerateRequest, OpenSessionRequest,
                                        RestoreRequest, SnapshotRequest)
from mambaserve.server.sessions.table import SessionError, TurnParams
from mambaserve.server.cache.radix_tree import CacheBusyError
from mambaserve.server.engine.request import BadRequest, FinishReason, SamplingParams, StepOutput

log = logging.getLogger(__name__)


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


class ClientGone(Exception):
    pass


def finish_info(out: StepOutput) -> dict | None:
    if out.finish_reason is None:
        return None
    info: dict = {"type": out.finish_reason.value}
    if out.finish_reason is FinishReason.STOP and out.matched_stop is not None:
        info["matched"] = out.matched_stop
    if out.error:
        info["message"] = out.error
    return info


def create_app(engine: Engine) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="mambaserve", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(BadRequest)
    async def _bad_request(_, e: BadRequest):
        engine.metrics.rejected.labels("too_long" if e.code == "context_length_exceeded" else "bad_request").inc()
        return error_response(e.status, str(e), e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        engine.metrics.rejected.labels("bad_request").inc()
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return error_response(400, f"malformed JSON body: {errors[0].get('ctx', {}).get('error', '')}".strip(),
                                  "invalid_json")
        parts = []
        for err in errors[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
        return error_response(422, "; ".join(parts), "invalid_field")

    @app.exception_handler(ClientGone)
    async def _gone(_, e):
        return Response(status_code=499)

    @app.get("/health")
    async def health():
        if not engine.scheduler.alive:
            return error_response(503, "scheduler is not running", "unavailable", "server_error")
        return PlainTextResponse("OK")

    @app.get("/health_generate")
    async def health_generate():
        params = SamplingParams(max_new_tokens=1, temperature=0)
        try:
            async with asyncio.timeout(30):
                # one token from a one-token prompt exercises the whole path: scheduler, model, sampler
                async for out in engine.generate([min(engine.eos_token_ids, default=0)], params):
                    if out.error:
                        return error_response(503, out.error, "unhealthy", "server_error")
        except TimeoutError:
            return error_response(503, "generation did not finish within 30 s", "unhealthy", "server_error")
        return PlainTextResponse("OK")

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return {"model_path": engine.cfg.model, "tokenizer_path": engine.cfg.tokenizer or engine.cfg.model,
                "served_model_name": engine.model_name, "is_generation": True,
                "architecture": "Mamba2ForCausalLM", "context_length": engine.context_length}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        accounting = await engine.run_in_scheduler(engine.scheduler.accounting)
        return {**engine.server_info(), "internal_states": [accounting]}

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest):
        engine.abort(body.rid)
        return {"success": True}

    @app.post("/flush_cache")
    async def flush_cache():
        try:
            freed = await engine.run_in_scheduler(engine.scheduler.flush_cache)
        except CacheBusyError as e:
            return error_response(409, str(e), "cache_busy")
        return {"success": True, "freed_snapshots": freed}

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if (body.text is None) == (body.input_ids is None):
            raise BadRequest("give exactly one of 'text' or 'input_ids'")
        ids = engine.encode(body.text) if body.text is not None else body.input_ids
        explicit = "max_new_tokens" in body.sampling_params.model_fields_set
        params = engine.check_prompt(ids, body.sampling_params.params(), explicit)
        sp = body.session_params
        turn = TurnParams(sp.rid, sp.offset, sp.replace, sp.drop_previous_output) if sp else None
        stream = await admitted(engine.generate(ids, params, rid=body.rid, return_logprob=body.return_logprob,
                                                top_logprobs_num=body.top_logprobs_num,
                                                session_id=sp.id if sp else None, turn_params=turn,
                                                stream=body.stream))
        if body.stream:
            return StreamingResponse(_native_stream(stream), media_type="text/event-stream")
        outs = await collect(request, stream)
        return _native_payload(outs, outs[-1].rid, body.return_logprob)

    def _native_payload(outs: list[StepOutput], rid: str, logprob: bool) -> dict:
        last = outs[-1]
        meta = {"id": rid, "prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                "cached_tokens": last.cached_tokens, "finish_reason": finish_info(last)}
        ids = [t for o in outs for t in o.token_ids]
        if logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for o in outs for lp, t in zip(o.logprobs or [], o.token_ids)]
            meta["output_top_logprobs"] = [[[v, i, None] for i, v in top] for o in outs for top in (o.top_logprobs or [])]
        return {"text": "".join(o.text for o in outs), "output_ids": ids, "meta_info": meta}

    async def _native_stream(stream: AsyncIterator[StepOutput]):
        outs: list[StepOutput] = []
        async with contextlib.aclosing(stream) as it:
            async for out in it:
                outs.append(out)
                payload = _native_payload(outs, out.rid, out.logprobs is not None)
                yield sse(payload)
        yield sse("[DONE]")

    @app.exception_handler(SessionError)
    async def _session_error(_, e: SessionError):
        return error_response(e.status, str(e), e.code)

    @app.post("/open_session")
    async def open_session(body: OpenSessionRequest):
        return await engine.run_in_scheduler(lambda: engine.scheduler.sessions.open(
            body.session_id, body.streaming, body.timeout, body.capacity_of_str_len))

    @app.post("/close_session")
    async def close_session(body: CloseSessionRequest):
        await engine.run_in_scheduler(lambda: engine.scheduler.sessions.close(body.session_id))
        return {"success": True}

    @app.post("/sessions/{session_id}/snapshot")
    async def snapshot_session(session_id: str, body: SnapshotRequest | None = None):
        name = body.name if body else None
        for _ in range(500):  # a turn that just answered folds its last token within a step
            try:
                return await engine.run_in_scheduler(lambda: engine.scheduler.sessions.snapshot(session_id, name))
            except SessionError as e:
                if e.code != "session_folding":
                    raise
            await asyncio.sleep(0.01)
        raise SessionError(503, f"session {session_id!r} did not become idle", "session_busy")

    @app.post("/sessions/restore")
    async def restore_session(body: RestoreRequest):
        return await engine.run_in_scheduler(lambda: engine.scheduler.sessions.restore(body.name, body.session_id))

    from mambaserve.server.api.openai import add_openai_routes

    add_openai_routes(app, engine)
    return app
