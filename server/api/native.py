"""SGLang-native endpoints: ``/generate``, model and server info, ``/abort_request``, ``/flush_cache``."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from mambaserve.server.api.protocol import AbortRequest, GenerateRequest
from mambaserve.server.api.responses import admitted, collect, error_response, finish_info, sse
from mambaserve.server.api.schemas import (ERRORS, FlushResult, GenerateResponse, ModelInfo, ServerInfo, Success,
                                           streamed)
from mambaserve.server.cache.radix_tree import CacheBusyError
from mambaserve.server.engine.engine import Engine
from mambaserve.server.engine.request import BadRequest, StepOutput


def native_routes(engine: Engine) -> APIRouter:
    router = APIRouter(responses=ERRORS)

    @router.get("/get_model_info", response_model=None, responses={200: {"model": ModelInfo}})
    @router.get("/model_info", response_model=None, responses={200: {"model": ModelInfo}})
    async def model_info():
        return engine.model_info()

    @router.get("/get_server_info", response_model=None, responses={200: {"model": ServerInfo}})
    @router.get("/server_info", response_model=None, responses={200: {"model": ServerInfo}})
    async def server_info():
        return await engine.server_info()

    @router.post("/abort_request", responses={200: {"model": Success}})
    async def abort_request(body: AbortRequest):
        engine.abort(body.rid)
        return {"success": True}

    @router.post("/flush_cache", responses={200: {"model": FlushResult}})
    async def flush_cache():
        try:
            freed = await engine.flush_cache()
        except CacheBusyError as e:
            return error_response(409, str(e), "cache_busy")
        return {"success": True, "freed_snapshots": freed}

    @router.post("/generate", responses=streamed(GenerateResponse))
    async def generate(body: GenerateRequest, request: Request):
        if (body.text is None) == (body.input_ids is None):
            raise BadRequest("give exactly one of 'text' or 'input_ids'")
        prompts, n = body.prompts(), body.sampling_params.n
        explicit = "max_new_tokens" in body.sampling_params.model_fields_set
        if body.batched or n > 1:  # a list of answers: n per prompt, prompt by prompt
            if body.stream or body.session_params or body.rid:
                raise BadRequest("a batch of prompts or n > 1 is answered as one list: stream, session_params and "
                                 "rid take a single prompt and n = 1", code="unsupported_parameter")
            engine.check_load(len(prompts) * n)
            ids = [await engine.tokenize(p) if isinstance(p, str) else p for p in prompts]
            params = [engine.check_prompt(i, body.sampling_params.params(), explicit) for i in ids]
            gens = [g for i, p in zip(ids, params)
                    for g in engine.generate_n(i, p, n, return_logprob=body.return_logprob,
                                               top_logprobs_num=body.top_logprobs_num, stream=False)]
            results = await collect(request, *gens)
            return [_native_payload(outs, outs[-1].rid, body.return_logprob) for outs in results]
        engine.check_load()
        ids = await engine.tokenize(prompts[0]) if isinstance(prompts[0], str) else prompts[0]
        params = engine.check_prompt(ids, body.sampling_params.params(), explicit)
        sp = body.session_params
        turn = sp.turn() if sp else None
        stream = engine.generate(ids, params, rid=body.rid, return_logprob=body.return_logprob,
                                 top_logprobs_num=body.top_logprobs_num, session_id=sp.id if sp else None,
                                 turn_params=turn, stream=body.stream)
        if body.stream:
            return StreamingResponse(_native_stream(await admitted(stream)), media_type="text/event-stream")
        (outs,) = await collect(request, stream)
        return _native_payload(outs, outs[-1].rid, body.return_logprob)

    return router


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
            yield sse(_native_payload(outs, out.rid, out.logprobs is not None))
    yield sse("[DONE]")
