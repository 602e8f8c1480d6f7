"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import contextlib
import time
import uuid

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from mambaserve.server.api.ownership import session_headers, turn_with_caller
from mambaserve.server.api.protocol import ChatRequest, CompletionRequest
from mambaserve.server.api.responses import admitted_all, collect, ended_early, merged, sse
from mambaserve.server.api.schemas import (ERRORS, ChatCompletionResponse, CompletionResponse, ModelCard, ModelList,
                                           streamed)
from mambaserve.server.engine.engine import Engine
from mambaserve.server.engine.request import BadRequest, StepOutput

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 512


def _usage(lasts: list[StepOutput | None], n: int) -> dict:
    """Usage of a request's choices (their last outputs, n per prompt): a prompt counts once, whatever n."""
    prompt = sum(o.prompt_tokens for o in lasts[::n] if o is not None)
    cached = sum(o.cached_tokens for o in lasts[::n] if o is not None)
    completion = sum(o.completion_tokens for o in lasts if o is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _input_logprobs(outs: list[StepOutput]) -> StepOutput | None:
    """The output that carries the prompt's logprobs (the first answer to a prompt computes them)."""
    return next((o for o in outs if o.input_logprobs is not None), None)


def openai_routes(engine: Engine) -> APIRouter:
    app = APIRouter(responses=ERRORS)

    # Names this server answers to: its served name; "unknown", which sglang-router sends for a chat request
    # without a model; and the model path, the id a router lists when it takes the model path as the
    # model's name (one model per server, so there is nothing to pick).
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

    def completion_logprobs(token_ids: list[int], lps: list, tops: list, offset: int) -> dict:
        """OpenAI's legacy logprobs object; ``tops`` entries: ``[(id, logprob), ...]``, or None."""
        tokens, offsets = [], []
        for t in token_ids:
            s = token_text(t)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": list(lps), "text_offset": offsets,
                "top_logprobs": [None if top is None else {token_text(a): v for a, v in top} for top in tops]}

    def output_logprobs(outs: list[StepOutput], offset: int) -> dict:
        ids = [t for o in outs for t in o.token_ids]
        lps = [lp for o in outs for lp in o.logprobs]
        tops = [top for o in outs for top in (o.top_logprobs or [None] * len(o.token_ids))]
        return completion_logprobs(ids, lps, tops, offset)

    def merge_logprobs(a: dict | None, b: dict) -> dict:
        return b if a is None else {k: a[k] + b[k] for k in b}

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
    async def completions(body: CompletionRequest, request: Request, response: Response):
        check_model(body.model)
        body.check_supported()
        explicit = body.max_tokens is not None
        base = body.sampling(body.max_tokens if explicit else DEFAULT_COMPLETION_TOKENS)
        n, want_lp = body.n, body.logprobs is not None
        session_id, turn = body.session(request.headers)
        turn = turn_with_caller(request, session_id, turn, body.session_params and body.session_params.secret)
        if session_id and (len(body.prompts()) != 1 or n != 1):
            raise BadRequest("a session turn takes a single prompt and n = 1", code="unsupported_parameter")
        if session_id and body.echo and want_lp:
            raise BadRequest("echo with logprobs is not supported on session turns (the history's logits are not "
                             "kept)", code="unsupported_parameter")
        engine.check_load(len(body.prompts()) * n)
        texts = body.prompts()
        prompts = [await engine.tokenize(p) if isinstance(p, str) else p for p in texts]
        params = [engine.check_prompt(ids, base, explicit) for ids in prompts]
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        # echo + logprobs: the prompt's own tokens' logprobs (the first is None), as SGLang's logprob_start_len 0
        gens = [g for ids, p in zip(prompts, params)
                for g in engine.generate_n(ids, p, n, return_logprob=want_lp, top_logprobs_num=body.logprobs or 0,
                                           logprob_start_len=0 if body.echo and want_lp else -1,
                                           session_id=session_id, turn_params=turn, stream=body.stream)]

        def echoed(i: int, lead: list[StepOutput]) -> tuple[str, dict | None]:
            """Choice i's echo: its prompt's text and, with logprobs, the prompt tokens' logprobs."""
            k = i // n
            text = texts[k] if isinstance(texts[k], str) else engine.tokenizer.decode(prompts[k])
            src = _input_logprobs(lead) if want_lp else None
            lp = None
            if src is not None:
                lp = completion_logprobs(src.input_token_ids, src.input_logprobs, src.input_top_logprobs, 0)
            return text, lp

        if body.stream:
            streams = await admitted_all(request, gens)

            async def events():
                outs: list[list[StepOutput]] = [[] for _ in gens]
                offsets = [0] * len(gens)
                # a copy's outputs that came before its prompt's logprobs (the first answer computes them)
                held: dict[int, list[tuple[int, StepOutput]]] = {}

                def chunk(i: int, out: StepOutput) -> dict | None:
                    outs[i].append(out)
                    text, lp = out.text, output_logprobs([out], offsets[i]) if want_lp else None
                    if body.echo and len(outs[i]) == 1:  # the prompt before the choice's first text
                        etext, elp = echoed(i, outs[i - i % n])
                        text, offsets[i] = etext + text, offsets[i] + len(etext)
                        if lp is not None:
                            lp = merge_logprobs(elp, output_logprobs([out], offsets[i]))
                    elif not out.text and not out.finished:
                        return None
                    offsets[i] += len(out.text)
                    return persisted({"id": cid, "object": "text_completion", "created": created,
                                      "model": engine.model_name,
                                      "choices": [{"index": i, "text": text, "logprobs": lp,
                                                   "finish_reason": out.finish_reason.value if out.finished else None}]},
                                     out)

                async with contextlib.aclosing(merged(streams)) as it:
                    async for i, out in it:
                        lead = i - i % n
                        if body.echo and want_lp and i != lead and _input_logprobs(outs[lead]) is None:
                            held.setdefault(lead, []).append((i, out))
                            continue
                        for j, o in [(i, out)] + (held.pop(lead, []) if i == lead else []):
                            if (c := chunk(j, o)) is not None:
                                yield sse(c)
                for j, o in [x for xs in held.values() for x in xs]:  # (a first answer that ended early)
                    if (c := chunk(j, o)) is not None:
                        yield sse(c)
                if body.include_usage:
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": engine.model_name,
                               "choices": [], "usage": _usage([o[-1] if o else None for o in outs], n)})
                yield sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream", headers=session_headers(turn, gens))

        results = await collect(request, *gens)
        response.headers.update(session_headers(turn, gens))
        choices = []
        for i, outs in enumerate(results):
            last = outs[-1]
            if last.error:
                return ended_early(last)
            text, lp = "".join(o.text for o in outs), output_logprobs(outs, 0) if want_lp else None
            if body.echo:
                etext, elp = echoed(i, results[i - i % n])
                text = etext + text
                if want_lp:
                    lp = merge_logprobs(elp, output_logprobs(outs, len(etext)))
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": last.finish_reason.value})
        return {"id": cid, "object": "text_completion", "created": created, "model": engine.model_name,
                "choices": choices, "usage": _usage([outs[-1] for outs in results], n)}

    @app.post("/v1/chat/completions", responses=streamed(ChatCompletionResponse))
    async def chat(body: ChatRequest, request: Request, response: Response):
        check_model(body.model)
        body.check_supported()
        n = body.n
        session_id, turn = body.session(request.headers)
        turn = turn_with_caller(request, session_id, turn, body.session_params and body.session_params.secret)
        if session_id and n != 1:
            raise BadRequest("a session turn takes n = 1", code="unsupported_parameter")
        engine.check_load(n)
        try:
            # with a session, `messages` are only the new turn's: rendered alone, appended to the history
            ids = await engine.tokenize_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as e:
            raise BadRequest(str(e)) from None
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(body, name)
        explicit = max_tokens is not None
        base = body.sampling(max_tokens if explicit else DEFAULT_CHAT_TOKENS, name)
        params = engine.check_prompt(ids, base, explicit)
        gens = engine.generate_n(ids, params, n, return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0,
                                 session_id=session_id, turn_params=turn, stream=body.stream)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            streams = await admitted_all(request, gens)

            async def events():
                lasts: list[StepOutput | None] = [None] * n
                async with contextlib.aclosing(merged(streams)) as it:
                    async for i, out in it:
                        first = lasts[i] is None
                        lasts[i] = out
                        if not out.text and not out.finished and not first:
                            continue
                        delta = {"role": "assistant", "content": out.text} if first else {"content": out.text}
                        choice = {"index": i, "delta": delta, "logprobs": chat_logprobs([out]) if body.logprobs else None,
                                  "finish_reason": out.finish_reason.value if out.finished else None}
                        yield sse(persisted({"id": cid, "object": "chat.completion.chunk", "created": created,
                                             "model": engine.model_name, "choices": [choice]}, out))
                if body.include_usage:
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                               "model": engine.model_name, "choices": [], "usage": _usage(lasts, n)})
                yield sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream", headers=session_headers(turn, gens))
        results = await collect(request, *gens)
        response.headers.update(session_headers(turn, gens))
        choices = []
        for i, outs in enumerate(results):
            last = outs[-1]
            if last.error:
                return ended_early(last)
            choices.append({"index": i, "message": {"role": "assistant", "content": "".join(o.text for o in outs)},
                            "logprobs": chat_logprobs(outs) if body.logprobs else None,
                            "finish_reason": last.finish_reason.value})
        return {"id": cid, "object": "chat.completion", "created": created, "model": engine.model_name,
                "choices": choices, "usage": _usage([outs[-1] for outs in results], n)}

    return app


def persisted(chunk: dict, out: StepOutput) -> dict:
    """A stream's last chunk of a ``--session-persist`` turn says whether the turn was written to storage."""
    if out.session_persisted is not None:
        chunk["session_persisted"] = out.session_persisted
    return chunk
