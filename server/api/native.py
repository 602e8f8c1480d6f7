"""SGLang-native endpoints: ``/generate``, model and server info, ``/abort_request``, ``/flush_cache``."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import APIRouter, Request, Response

from mambaserve.server.api.ownership import session_headers, turn_with_caller
from mambaserve.server.api.protocol import AbortRequest, GenerateRequest
from mambaserve.server.api.responses import (DONE, Admission, SSEResponse, collect, error_response, finish_info,
                                               merged, sse)
from mambaserve.server.api.schemas import (ERRORS, FlushResult, GenerateResponse, Load, ModelInfo, ServerInfo,
                                           Success, streamed)
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

    @router.get("/get_load", responses={200: {"model": list[Load]}})
    async def get_load():
        # SGLang's shape, one entry per data-parallel rank (one here): sglang-router sums num_tokens
        return [{"dp_rank": 0, **await engine.load()}]

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
    async def generate(body: GenerateRequest, request: Request, response: Response):
        body.check_supported()
        if (body.text is None) == (body.input_ids is None):
            raise BadRequest("give exactly one of 'text' or 'input_ids'")
        prompts, n, sp = body.prompts(), body.sampling_params.n, body.session_params
        explicit = "max_new_tokens" in body.sampling_params.model_fields_set
        many = body.batched or n > 1  # a list of answers: n per prompt, prompt by prompt
        if many and (sp or body.rid):
            raise BadRequest("session_params and rid take a single prompt and n = 1", code="unsupported_parameter")
        if sp and body.return_logprob and body.logprob_start_len >= 0:
            raise BadRequest("logprob_start_len is not supported on session turns (the history's logits are "
                             "not kept)", code="unsupported_parameter")
        engine.check_load(len(prompts) * n)
        ids = [await engine.tokenize(p) if isinstance(p, str) else p for p in prompts]
        params = [engine.check_prompt(i, body.sampling_params.params(), explicit) for i in ids]
        grammar = await engine.compile_grammar(params[0])
        await engine.before_submit(len(prompts) * n)
        if body.return_logprob and any(body.logprob_start_len >= len(i) for i in ids):
            raise BadRequest(f"logprob_start_len {body.logprob_start_len} is past the prompt's last token "
                             f"(prompts of {min(len(i) for i in ids)} tokens)")
        kw = dict(return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num,
                  logprob_start_len=body.logprob_start_len, stream=body.stream, grammar=grammar)
        turn = None
        if many:
            gens = [g for i, p in zip(ids, params) for g in engine.generate_n(i, p, n, **kw)]
        else:
            session_id = sp.session_id(request.headers) if sp else None
            turn = turn_with_caller(request, session_id, sp.turn() if sp else None, sp.secret if sp else None)
            gens = [engine.generate(ids[0], params[0], rid=body.rid, session_id=session_id, turn_params=turn, **kw)]
        payload = _Payload(engine.tokenizer if body.return_text_in_logprobs else None, body.return_logprob, n)
        if body.stream:
            admission = Admission(gens)
            return SSEResponse(_native_stream(admission.streams, payload, many), lambda: session_headers(turn, gens),
                               admission)
        results = await collect(request, *gens)
        response.headers.update(session_headers(turn, gens))
        answers = [payload(outs, results, i) for i, outs in enumerate(results)]
        return answers if many else answers[0]

    return router


class _Payload:
    """``/generate``'s answer for one choice: text, ids, meta_info (logprobs as ``[logprob, id, text]``,
    text only with ``return_text_in_logprobs``). With n > 1 the prompt's logprobs are computed once,
    by the first answer to the prompt, and reported with each."""

    def __init__(self, tokenizer, logprob: bool, n: int):
        self.tokenizer, self.logprob, self.n = tokenizer, logprob, n

    def _entry(self, lp, t):
        return [lp, t, self.tokenizer.decode([t]) if self.tokenizer is not None else None]

    def _top(self, top):
        return None if top is None else [self._entry(v, i) for i, v in top]

    def __call__(self, outs: list[StepOutput], all_outs: list[list[StepOutput]], index: int) -> dict:
        last = outs[-1]
        meta = {"id": last.rid, "prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                "cached_tokens": last.cached_tokens, "finish_reason": finish_info(last)}
        if last.session_persisted is not None:
            meta["session_persisted"] = last.session_persisted
        if self.logprob:
            meta["output_token_logprobs"] = [self._entry(lp, t) for o in outs
                                             for lp, t in zip(o.logprobs or [], o.token_ids)]
            meta["output_top_logprobs"] = [self._top(top) for o in outs for top in (o.top_logprobs or [])]
            lead = all_outs[index - index % self.n]
            first = next((o for o in [*outs, *lead] if o.input_logprobs is not None), None)
            if first is not None:
                meta["input_token_logprobs"] = [self._entry(lp, t)
                                                for lp, t in zip(first.input_logprobs, first.input_token_ids)]
                meta["input_top_logprobs"] = [self._top(top) for top in first.input_top_logprobs]
        return {"text": "".join(o.text for o in outs), "output_ids": [t for o in outs for t in o.token_ids],
                "meta_info": meta}


async def _native_stream(streams: list[AsyncIterator[StepOutput]], payload: _Payload, many: bool):
    """SSE: after each increment, the choice's answer so far; with several choices each carries its
    ``index``. Closing the response (a client gone) closes every choice's stream: all are aborted."""
    outs: list[list[StepOutput]] = [[] for _ in streams]
    async with contextlib.aclosing(merged(streams)) as it:
        async for i, out in it:
            outs[i].append(out)
            answer = payload(outs[i], outs, i)
            if many:
                answer["index"] = i
            yield sse(answer)
    yield DONE
