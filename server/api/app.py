"""The FastAPI app: lifespan, error mapping, health, metrics, and the routers of the endpoints.

Handlers never block: they call ``Engine`` methods, which hand work to the scheduler thread and
await its results. Native (SGLang) endpoints are in ``native``, sessions in ``sessions``, OpenAI's in
``openai``; ``responses`` holds the helpers they share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from mambaserve.server.api.auth import ApiKeyAuth
from mambaserve.server.api.json_body import JsonBody
from mambaserve.server.api.limits import BodyLimit
from mambaserve.server.api.native import native_routes
from mambaserve.server.api.openai import openai_routes
from mambaserve.server.api.responses import ClientGone, error_response
from mambaserve.server.api.schemas import ERRORS, PLAIN_TEXT
from mambaserve.server.api.timing import StageTimer
from mambaserve.server.api.tokens import token_routes
from mambaserve.server.api.sessions import session_routes
from mambaserve.server.engine.engine import Engine
from mambaserve.server.engine.request import BadRequest, Overloaded, SamplingParams
from mambaserve.server.sessions.table import SessionError

log = logging.getLogger(__name__)


# pydantic's error types for a value of the right type that its field does not take
VALUE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of",
                          "too_short", "too_long", "string_too_short", "string_too_long", "literal_error", "enum",
                          "union_tag_invalid", "finite_number", "value_error"})


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
        if isinstance(e, Overloaded):
            engine.metrics.rejected.labels("overloaded").inc()
            response = error_response(e.status, str(e), e.code, "server_error")
            response.headers["Retry-After"] = str(e.retry_after_s)
            return response
        engine.metrics.rejected.labels("too_long" if e.code == "context_length_exceeded" else "bad_request").inc()
        return error_response(e.status, str(e), e.code)

    @app.exception_handler(SessionError)
    async def _session_error(_, e: SessionError):
        return error_response(e.status, str(e), e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        """400 where every error is a value the field does not take (out of range, too short, not one of its
        choices, our validators' checks), as the engine's own checks of values answer; 422 where a field has the
        wrong type or the body the wrong shape."""
        engine.metrics.rejected.labels("bad_request").inc()
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return error_response(400, f"malformed JSON body: {errors[0].get('ctx', {}).get('error', '')}".strip(),
                                  "invalid_json")
        parts = []
        for err in errors[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            kind, msg = err.get("type", ""), str(err.get("msg", ""))
            if not loc and kind == "missing":
                msg = "the request needs a JSON body"
            elif not loc and kind in ("dict_type", "model_attributes_type"):
                msg = "the request body must be a JSON object"
            elif kind == "value_error":  # our validators' own sentences, which name their field
                msg = msg.removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
        status = 400 if all(err.get("type") in VALUE_ERRORS for err in errors) else 422
        return error_response(status, "; ".join(parts), "invalid_field")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        # the framework's own refusals (unparsable body, unknown route, wrong method) in the same envelope
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request")
        return error_response(e.status_code, str(e.detail), code)

    @app.exception_handler(ClientGone)
    async def _gone(_, e):
        return Response(status_code=499)

    @app.get("/health", response_class=PlainTextResponse, responses={**PLAIN_TEXT, 503: ERRORS[503]})
    async def health(stuck_step_timeout: float | None = None):
        """200 while the scheduler runs and its accounting adds up (503 once a failed step left slots or pages
        that could not be reclaimed). With ``stuck_step_timeout`` (seconds; a liveness probe's), also 503
        when a step has run longer than that with requests pending (a wedged GPU or a hung kernel); an idle
        server stays live."""
        if not engine.healthy:
            return error_response(503, "scheduler is not running", "unavailable", "server_error")
        if engine.capacity_lost:
            return error_response(503, engine.capacity_lost, "unavailable", "server_error")
        degraded = f"; {engine.storage_status}" if engine.storage_status else ""  # (serving all the same)
        if stuck_step_timeout is None:
            return PlainTextResponse(f"OK{degraded}")
        live, p = engine.liveness(stuck_step_timeout)
        detail = (f"{p['steps']} steps, the last ended {p['last_step_seconds_ago']:.1f} s ago, "
                  f"{p['pending_requests']} requests pending")
        if not live:
            return error_response(503, f"a step has run {p['step_running_seconds']:.1f} s (stuck_step_timeout "
                                       f"{stuck_step_timeout:g} s); {detail}", "unavailable", "server_error")
        return PlainTextResponse(f"OK: {detail}{degraded}")

    # HEAD too: some load balancers' health checks send it
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/health_generate", response_class=PlainTextResponse, responses={**PLAIN_TEXT, **ERRORS})
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

    @app.get("/metrics", response_class=PlainTextResponse, responses=PLAIN_TEXT)
    async def metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(JsonBody)
    app.add_middleware(BodyLimit, max_bytes=engine.cfg.max_request_bytes,
                       on_reject=lambda: engine.metrics.rejected.labels("too_large").inc())
    if engine.cfg.api_key:  # added last: it runs first, before any body is read
        app.add_middleware(ApiKeyAuth, keys=engine.cfg.api_keys,
                           on_reject=lambda: engine.metrics.rejected.labels("unauthorized").inc())
    app.add_middleware(StageTimer, histogram=engine.metrics.stages)  # outermost: stamps arrival first
    app.include_router(native_routes(engine))
    app.include_router(session_routes(engine))
    app.include_router(openai_routes(engine))
    app.include_router(token_routes(engine))
    return app
