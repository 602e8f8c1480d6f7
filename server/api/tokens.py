"""``/tokenize`` and ``/detokenize`` (vLLM's paths, and SGLang's ``/v1/`` forms), ``/version``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from mambaserve.server.api.openai import chat_prompt
from mambaserve.server.api.protocol import ChatRequest, DetokenizeRequest, TokenizeRequest
from mambaserve.server.api.schemas import ERRORS, DetokenizeResult, TokenizeResult, Version
from mambaserve.server.engine.engine import Engine, package_version
from mambaserve.server.engine.request import BadRequest


def token_routes(engine: Engine) -> APIRouter:
    """A conversation is rendered by the chat endpoint's own ``chat_prompt``: it tokenizes here exactly as
    it would be served."""
    router = APIRouter(responses=ERRORS)
    tok = engine.tokenizer

    async def tokenize(body: TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give exactly one of 'prompt' or 'messages'")
        if body.messages is not None:
            chat = ChatRequest(messages=body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message,
                               chat_template_kwargs=body.chat_template_kwargs)
            ids, _ = await chat_prompt(engine, chat)
            batch = [ids]
        else:
            prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            batch = await asyncio.to_thread(lambda: [tok.encode(p, add_special_tokens=body.add_special_tokens)
                                                     for p in prompts])
        single = not isinstance(body.prompt, list)
        out = {"tokens": batch[0] if single else batch, "count": sum(map(len, batch)),
               "max_model_len": engine.context_length}
        if body.return_token_strs:
            strs = [tok.convert_ids_to_tokens(ids) for ids in batch]
            out["token_strs"] = strs[0] if single else strs
        return out

    async def detokenize(body: DetokenizeRequest):
        nested = bool(body.tokens) and isinstance(body.tokens[0], list)
        batch = body.tokens if nested else [body.tokens]
        engine.check_token_ids(t for ids in batch for t in ids)
        texts = await asyncio.to_thread(lambda: [tok.decode(ids) for ids in batch])
        text = texts if nested else texts[0]
        return {"prompt": text, "text": text}

    for path in ("/tokenize", "/v1/tokenize"):
        router.add_api_route(path, tokenize, methods=["POST"], responses={200: {"model": TokenizeResult}})
    for path in ("/detokenize", "/v1/detokenize"):
        router.add_api_route(path, detokenize, methods=["POST"], responses={200: {"model": DetokenizeResult}})

    @router.get("/version", responses={200: {"model": Version}})
    async def version():
        return {"version": package_version()}

    return router
