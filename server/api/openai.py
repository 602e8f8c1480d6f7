"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import contextlib
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from mambaserve.server.api.protocol import ChatRequest, CompletionRequest
from mambaserve.server.api.responses import admitted, collect, ended_early, sse
from mambaserve.server.api.schemas import (ERRORS, ChatCompletionResponse, CompletionResponse, ModelCard, ModelList,
                                           streamed)
from mambaserve.server.engine.engine import Engine
from mambaserve.server.engine.request import BadRequest, StepOutput

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 512


def _usage(last: StepOutput) -> dict:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}


def openai_routes(engine: Engine) -> APIRouter:
    app = APIRouter(responses=ERRORS)

    # Names this server answers to: its served name; "unknown", which sglang-router sends for a chat request
    # without a model; and the model path, the id sglang-router lists in its /v1/models (one model per
    # server, so there is nothing to pick).
    aliases = {engine.model_name, "unknown", engine.model_info()["model_path"], engine.cfg.model}

    def check_model(name: str | None) -> None:
        if name is not None and name not in aliases:
            raise BadRequest(f"model {name!r} does not exist; this server serves {engine.model_name!r}",
                             code="model_not_found", status=404)

    def model_card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": int(time.time()), "owned_by": "mambaserve",
                "max_model_len": engine.context_length}

    def token_text(t: int) -> str:
        return engine.tokenizer.decode([t])

    def completion_logprobs(outs: list[StepOutput], offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for o in outs:
            for i, t in enumerate(o.token_ids):
                s = token_text(t)
                tokens.append(s)
                lps.append(o.logprobs[i])
                tops.append({token_text(a): v for a, v in o.top_logprobs[i]} if o.top_logprobs else None)
                offsets.append(offset)
                offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(outs: list[StepOutput]) -> dict:
        content = []
        for o in outs:
            for i, t in enumerate(o.token_ids):
                s = token_text(t)
                content.append({"token": s, "logprob": o.logprobs[i], "bytes": list(s.encode()),
                                "top_logprobs": [{"token": token_text(a), "logprob": v, "bytes": list(token_text(a).encode())}
                                                 for a, v in (o.top_logprobs[i] if o.top_logprobs else [])]})
        return {"content": content}

    @app.get("/v1/models", responses={200: {"model": ModelList}})
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses={200: {"model": ModelCard}})
    async def model(model_id: str):
        if model_id != engine.model_name:
            raise BadRequest(f"model {model_id!r} does not exist; this server serves {engine.model_name!r}",
                             code="model_not_found", status=404)
        return model_card()

    @app.post("/v1/completions", responses=streamed(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.echo:
            raise BadRequest("echo is not supported", code="unsupported_parameter")
        explicit = body.max_tokens is not None
        base = body.sampling(body.max_tokens if explicit else DEFAULT_COMPLETION_TOKENS)
        engine.check_load(len(body.prompts()) * body.n)
        prompts = [await engine.tokenize(p) if isinstance(p, str) else p for p in body.prompts()]
        params = [engine.check_prompt(ids, base, explicit) for ids in prompts]
        want_lp = body.logprobs is not None
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        session_id, turn = body.session(request.headers)
        if (session_id or body.stream) and (len(prompts) != 1 or body.n != 1):
            raise BadRequest("streaming and session turns take a single prompt and n = 1")
        streams = [g for ids, p in zip(prompts, params)
                   for g in engine.generate_n(ids, p, body.n, return_logprob=want_lp,
                                              top_logprobs_num=body.logprobs or 0, session_id=session_id,
                                              turn_params=turn,
                                              stream=body.stream)]

        if body.stream:
            stream = await admitted(streams[0])

            async def events():
                offset = 0
                async with contextlib.aclosing(stream) as it:
                    async for out in it:
                        if not out.text and not out.finished:
                            continue
                        choice = {"index": 0, "text": out.text, "logprobs": None,
                                  "finish_reason": out.finish_reason.value if out.finished else None}
                        if want_lp:
                            choice["logprobs"] = completion_logprobs([out], offset)
                        offset += len(out.text)
                        yield sse({"id": cid, "object": "text_completion", "created": created,
                                   "model": engine.model_name, "choices": [choice]})
                        last = out
                if body.include_usage:
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": engine.model_name,
                               "choices": [], "usage": _usage(last)})
                yield sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        results = await collect(request, *streams)
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                              "prompt_tokens_details": {"cached_tokens": 0}}
        for i, outs in enumerate(results):
            last = outs[-1]
            if last.error:
                return ended_early(last)
            choices.append({"index": i, "text": "".join(o.text for o in outs),
                            "logprobs": completion_logprobs(outs, 0) if want_lp else None,
                            "finish_reason": last.finish_reason.value})
            first_of_prompt = i % body.n == 0  # a prompt's tokens count once, whatever n
            usage["prompt_tokens"] += last.prompt_tokens if first_of_prompt else 0
            usage["completion_tokens"] += last.completion_tokens
            usage["prompt_tokens_details"]["cached_tokens"] += last.cached_tokens if first_of_prompt else 0
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"id": cid, "object": "text_completion", "created": created, "model": engine.model_name,
                "choices": choices, "usage": usage}

    @app.post("/v1/chat/completions", responses=streamed(ChatCompletionResponse))
    async def chat(body: ChatRequest, request: Request):
        check_model(body.model)
        session_id, turn = body.session(request.headers)
        if session_id and body.n != 1:
            raise BadRequest("a session turn takes n = 1", code="unsupported_parameter")
        engine.check_load(body.n)
        try:
            # with a session, `messages` are only the new turn's: rendered alone, appended to the history
            ids = await engine.tokenize_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as e:
            raise BadRequest(str(e)) from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        explicit = max_tokens is not None
        params = engine.check_prompt(ids, body.sampling(max_tokens if explicit else DEFAULT_CHAT_TOKENS), explicit)
        top_n = body.top_logprobs or 0
        gens = engine.generate_n(ids, params, body.n, return_logprob=body.logprobs, top_logprobs_num=top_n,
                                 session_id=session_id, turn_params=turn, stream=body.stream)
        stream = gens[0]
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            stream = await admitted(stream)

            async def events():
                first = True
                async with contextlib.aclosing(stream) as it:
                    async for out in it:
                        if not out.text and not out.finished and not first:
                            continue
                        delta = {"role": "assistant", "content": out.text} if first else {"content": out.text}
                        first = False
                        choice = {"index": 0, "delta": delta, "logprobs": chat_logprobs([out]) if body.logprobs else None,
                                  "finish_reason": out.finish_reason.value if out.finished else None}
                        yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                                   "model": engine.model_name, "choices": [choice]})
                        last = out
                if body.include_usage:
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                               "model": engine.model_name, "choices": [], "usage": _usage(last)})
                yield sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")
        results = await collect(request, *gens)
        choices = []
        for i, outs in enumerate(results):
            last = outs[-1]
            if last.error:
                return ended_early(last)
            choices.append({"index": i, "message": {"role": "assistant", "content": "".join(o.text for o in outs)},
                            "logprobs": chat_logprobs(outs) if body.logprobs else None,
                            "finish_reason": last.finish_reason.value})
        usage = _usage(results[0][-1])
        usage["completion_tokens"] = sum(outs[-1].completion_tokens for outs in results)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"id": cid, "object": "chat.completion", "created": created, "model": engine.model_name,
                "choices": choices, "usage": usage}

    return app
