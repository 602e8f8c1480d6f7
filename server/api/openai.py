"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid

from fastapi import APIRouter, Request, Response

from mambaserve.server.api import tool_calls
from mambaserve.server.api.ownership import session_headers, turn_with_caller
from mambaserve.server.api.protocol import ChatRequest, CompletionRequest, NamedToolChoice
from mambaserve.server.api.responses import DONE, Admission, Last, SSEResponse, collect, ended_early, merged, sse
from mambaserve.server.api.schemas import (ERRORS, ChatCompletionResponse, CompletionResponse, ModelCard, ModelList,
                                           streamed)
from mambaserve.server.engine.engine import Engine
from mambaserve.server.engine.request import BadRequest, FinishReason, StepOutput

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions (a chat's: the rest of the context)


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


async def chat_prompt(engine: Engine, body: ChatRequest) -> tuple[list[int], list[dict] | None]:
    """The conversation rendered by the model's template and tokenized (its tools in the template's ``tools``,
    or in a system message of this server's where the template reads none); and the tools, as dicts."""
    template = getattr(engine.tokenizer, "chat_template", None)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    messages = [m.for_template() for m in body.messages]
    reads_tools = tool_calls.reads_tools(template)
    if tools and not reads_tools:
        messages = tool_calls.with_tool_prompt(messages, tools, tool_calls.detect(template))
    try:
        ids = await engine.tokenize_chat(messages, tools if reads_tools else None, **body.template_args())
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return body.truncated(ids), tools


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

    def completion_logprobs(token_ids: list[int], lps: list, tops: list, offset: int, k: int) -> dict:
        """OpenAI's legacy logprobs object; ``tops`` entries: ``[(id, logprob), ...]`` (the first ``k`` are
        reported), or None."""
        tokens, offsets = [], []
        for t in token_ids:
            s = token_text(t)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": list(lps), "text_offset": offsets,
                "top_logprobs": [None if top is None else {token_text(a): v for a, v in top[:k]} for top in tops]}

    def output_logprobs(outs: list[StepOutput], offset: int, k: int) -> dict:
        ids = [t for o in outs for t in o.token_ids]
        lps = [lp for o in outs for lp in o.logprobs]
        tops = [top for o in outs for top in (o.top_logprobs or [None] * len(o.token_ids))]
        return completion_logprobs(ids, lps, tops, offset, k)

    def prompt_logprobs(src: StepOutput | None, k: int) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token (the first: null) its logprob and the top ``k``, by token
        id, each with its rank (null for the prompt's own token when it is not among the top k)."""
        if src is None:
            return None
        out = []
        for tok, lp, top in zip(src.input_token_ids, src.input_logprobs, src.input_top_logprobs):
            if lp is None:
                out.append(None)
                continue
            entry = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": token_text(t)}
                     for r, (t, v) in enumerate((top or [])[:k])}
            entry.setdefault(str(tok), {"logprob": lp, "rank": None, "decoded_token": token_text(tok)})
            out.append(entry)
        return out

    def merge_logprobs(a: dict | None, b: dict) -> dict:
        return b if a is None else {k: a[k] + b[k] for k in b}

    def chat_logprobs(outs: list[StepOutput], k: int) -> dict:
        content = []
        for o in outs:
            for i, t in enumerate(o.token_ids):
                s = token_text(t)
                content.append({"token": s, "logprob": o.logprobs[i], "bytes": list(s.encode()),
                                "top_logprobs": [{"token": token_text(a), "logprob": v, "bytes": list(token_text(a).encode())}
                                                 for a, v in (o.top_logprobs[i][:k] if o.top_logprobs else [])]})
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
        n, want_lp, prompt_lp = body.n, body.logprobs is not None, body.prompt_logprobs is not None
        session_id, turn = body.session(request.headers)
        turn = turn_with_caller(request, session_id, turn, body.session_params and body.session_params.secret)
        if session_id and (len(body.prompts()) != 1 or n != 1):
            raise BadRequest("a session turn takes a single prompt and n = 1", code="unsupported_parameter")
        if session_id and (body.echo and want_lp or prompt_lp):
            raise BadRequest("echo with logprobs and prompt_logprobs are not supported on session turns (the "
                             "history's logits are not kept)", code="unsupported_parameter")
        engine.check_load(len(body.prompts()) * n)
        texts = body.prompts()
        prompts = [body.truncated(await engine.tokenize(p) if isinstance(p, str) else p) for p in texts]
        params = [engine.check_prompt(ids, base, explicit) for ids in prompts]
        grammar = await engine.compile_grammar(base)
        await engine.before_submit(len(texts) * n)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        # echo + logprobs, prompt_logprobs: the prompt's own tokens' logprobs (the first is None), as SGLang's
        # logprob_start_len 0
        gens = [g for ids, p in zip(prompts, params)
                for g in engine.generate_n(ids, p, n, return_logprob=want_lp or prompt_lp,
                                           top_logprobs_num=max(body.logprobs or 0, body.prompt_logprobs or 0),
                                           logprob_start_len=0 if body.echo and want_lp or prompt_lp else -1,
                                           session_id=session_id, turn_params=turn, stream=body.stream,
                                           grammar=grammar)]

        def echoed(i: int, lead: list[StepOutput]) -> tuple[str, dict | None]:
            """Choice i's echo: its prompt's text and, with logprobs, the prompt tokens' logprobs."""
            k = i // n
            whole = isinstance(texts[k], str) and not body.truncate_prompt_tokens
            text = texts[k] if whole else engine.tokenizer.decode(prompts[k])
            src = _input_logprobs(lead) if want_lp else None
            lp = None
            if src is not None:
                lp = completion_logprobs(src.input_token_ids, src.input_logprobs, src.input_top_logprobs, 0,
                                         body.logprobs)
            return text, lp

        if body.stream:
            admission = Admission(gens)
            streams = admission.streams  # (filled once the response has them admitted)

            async def events():
                outs: list[list[StepOutput]] = [[] for _ in gens]
                offsets = [0] * len(gens)
                # a copy's outputs that came before its prompt's logprobs (the first answer computes them)
                held: dict[int, list[tuple[int, StepOutput]]] = {}

                def chunk(i: int, out: StepOutput) -> dict | None:
                    outs[i].append(out)
                    text, elp, first = out.text, None, len(outs[i]) == 1
                    if body.echo and first:  # the prompt before the choice's first text
                        etext, elp = echoed(i, outs[i - i % n])
                        text, offsets[i] = etext + text, offsets[i] + len(etext)
                    elif not out.text and not out.finished and not (first and prompt_lp):
                        return None
                    lp = merge_logprobs(elp, output_logprobs([out], offsets[i], body.logprobs)) if want_lp else None
                    offsets[i] += len(out.text)
                    choice = {"index": i, "text": text, "logprobs": lp,
                              "finish_reason": out.finish_reason.value if out.finished else None}
                    if prompt_lp and first:
                        choice["prompt_logprobs"] = prompt_logprobs(_input_logprobs(outs[i - i % n]),
                                                                    body.prompt_logprobs)
                    return persisted({"id": cid, "object": "text_completion", "created": created,
                                      "model": engine.model_name, "choices": [choice]}, out)

                async with contextlib.aclosing(merged(streams)) as it:
                    async for i, out in it:
                        lead = i - i % n
                        if (body.echo and want_lp or prompt_lp) and i != lead and _input_logprobs(outs[lead]) is None:
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
                yield DONE

            return SSEResponse(events(), lambda: session_headers(turn, gens), admission)

        results = await collect(request, *gens)
        response.headers.update(session_headers(turn, gens))
        choices = []
        for i, outs in enumerate(results):
            last = outs[-1]
            if last.error:
                return ended_early(last)
            text, lp = "".join(o.text for o in outs), output_logprobs(outs, 0, body.logprobs) if want_lp else None
            if body.echo:
                etext, elp = echoed(i, results[i - i % n])
                text = etext + text
                if want_lp:
                    lp = merge_logprobs(elp, output_logprobs(outs, len(etext), body.logprobs))
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": last.finish_reason.value})
            if prompt_lp:
                choices[-1]["prompt_logprobs"] = prompt_logprobs(_input_logprobs(results[i - i % n]),
                                                                 body.prompt_logprobs)
        return {"id": cid, "object": "text_completion", "created": created, "model": engine.model_name,
                "choices": choices, "usage": _usage([outs[-1] for outs in results], n)}

    tool_format = tool_calls.detect(getattr(engine.tokenizer, "chat_template", None))
    tool_tags = tool_calls.special_tags(tool_format, engine.tokenizer)

    @app.post("/v1/chat/completions", responses=streamed(ChatCompletionResponse))
    async def chat(body: ChatRequest, request: Request, response: Response):
        check_model(body.model)
        body.check_supported()
        n, prompt_lp, k = body.n, body.prompt_logprobs is not None, body.top_logprobs or 0
        session_id, turn = body.session(request.headers)
        turn = turn_with_caller(request, session_id, turn, body.session_params and body.session_params.secret)
        if session_id and (n != 1 or prompt_lp):
            raise BadRequest("a session turn takes n = 1 and no prompt_logprobs", code="unsupported_parameter")
        engine.check_load(n)
        # with a session, `messages` are only the new turn's: rendered alone, appended to the history
        ids, tools = await chat_prompt(engine, body)
        choice = tool_calls.check_choice(tools, body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice)
                                         else body.tool_choice)
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(body, name)
        explicit = max_tokens is not None  # (without it: the rest of the context)
        base = body.sampling(max_tokens if explicit else engine.context_length, name)
        if choice not in ("none", "auto"):  # required, or a named function: only calls can be written
            if base.constraint is not None:
                raise BadRequest(f"tool_choice {choice!r} cannot be combined with {base.name('constraint')}")
            chosen = [t for t in tools if choice == "required" or t["function"]["name"] == choice]
            grammar_text = tool_calls.grammar(chosen, tool_format, body.parallel_tool_calls and choice == "required",
                                              tool_tags)
            base = dataclasses.replace(base, constraint=("lark", grammar_text),
                                       names={**base.names, "constraint": "tool_choice"})
        parse = tools is not None and choice != "none"
        if parse and tool_tags:  # the tags are special tokens: kept in the text for the parser
            base = dataclasses.replace(base, skip_special_tokens=False)
        params = engine.check_prompt(ids, base, explicit)
        grammar = await engine.compile_grammar(params)
        await engine.before_submit(n)
        gens = engine.generate_n(ids, params, n, return_logprob=body.logprobs or prompt_lp,
                                 top_logprobs_num=max(k, body.prompt_logprobs or 0),
                                 logprob_start_len=0 if prompt_lp else -1, session_id=session_id, turn_params=turn,
                                 stream=body.stream, grammar=grammar)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        parsers = [tool_calls.ToolCallParser(tool_format, tools, body.parallel_tool_calls) if parse else None
                   for _ in range(n)]

        def finish_reason(i: int, out: StepOutput) -> str:
            called = parsers[i] is not None and parsers[i].calls
            return "tool_calls" if called and out.finish_reason is FinishReason.STOP else out.finish_reason.value

        if body.stream:
            admission = Admission(gens)
            streams = admission.streams  # (filled once the response has them admitted)

            def end() -> str:
                usage = sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name,
                             "choices": [], "usage": _usage(lasts, n)}) if body.include_usage else ""
                return Last(usage + DONE)

            lasts: list[StepOutput | None] = [None] * n

            async def events():
                live = n
                async with contextlib.aclosing(merged(streams)) as it:
                    async for i, out in it:
                        first = lasts[i] is None
                        lasts[i] = out
                        text, calls, parser = out.text, [], parsers[i]
                        if parser is not None:
                            text, calls = parser.feed(text)
                            text += parser.finish() if out.finished else ""
                        if not text and not calls and not out.finished and not first:
                            continue
                        delta = {"role": "assistant"} if first else {}
                        if text or not calls:
                            delta["content"] = (body.echoed if first else "") + text
                        if calls:
                            start = len(parser.calls) - len(calls)
                            delta["tool_calls"] = [{"index": start + c, **call} for c, call in enumerate(calls)]
                        choice_ = {"index": i, "delta": delta, "logprobs": chat_logprobs([out], k) if body.logprobs else None,
                                   "finish_reason": finish_reason(i, out) if out.finished else None}
                        chunk = {"id": cid, "object": "chat.completion.chunk", "created": created,
                                 "model": engine.model_name, "choices": [choice_]}
                        if out.input_logprobs is not None and prompt_lp:
                            chunk["prompt_logprobs"] = prompt_logprobs(out, body.prompt_logprobs)
                        live -= 1 if out.finished else 0
                        if not live:  # the last chunk, the usage, [DONE] and the body's end: one write
                            yield Last(sse(persisted(chunk, out)) + end())
                            return
                        yield sse(persisted(chunk, out))
                yield end()

            return SSEResponse(events(), lambda: session_headers(turn, gens), admission)
        results = await collect(request, *gens)
        response.headers.update(session_headers(turn, gens))
        choices = []
        for i, outs in enumerate(results):
            last = outs[-1]
            if last.error:
                return ended_early(last)
            text, message = "".join(o.text for o in outs), {"role": "assistant"}
            if parsers[i] is not None:
                text, calls = parsers[i].feed(text)
                text += parsers[i].finish()
                if calls:
                    message["tool_calls"] = calls
            message["content"] = body.echoed + text if text or not parsers[i] or not parsers[i].calls else None
            choices.append({"index": i, "message": message, "logprobs": chat_logprobs(outs, k) if body.logprobs else None,
                            "finish_reason": finish_reason(i, last)})
        answer = {"id": cid, "object": "chat.completion", "created": created, "model": engine.model_name,
                  "choices": choices, "usage": _usage([outs[-1] for outs in results], n)}
        if prompt_lp:
            answer["prompt_logprobs"] = prompt_logprobs(_input_logprobs(results[0]), body.prompt_logprobs)
        return answer

    return app


def persisted(chunk: dict, out: StepOutput) -> dict:
    """A stream's last chunk of a ``--session-persist`` turn says whether the turn was written to storage."""
    if out.session_persisted is not None:
        chunk["session_persisted"] = out.session_persisted
    return chunk
