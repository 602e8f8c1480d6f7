"""The server's own first requests, before it reports ready: a short greedy and a short sampled generation
through the whole app (routing, validation, the scheduler, sampling, the answer), as SGLang's server does.

Whatever runs only on a first request (first validation, first pass through the scheduler's paths, the
sampler's kernels) is paid here instead of by the first clients: the first 8-request burst through HTTP
on an H100 was 3% slower than the next. Beside them the grammar engine reads the tokenizer (structured
outputs' one-time setup). The radix cache (device and host tiers) is emptied afterwards, so
the warm-up leaves no snapshot in memory; a storage tier keeps the warm-up prompt's snapshots it wrote (a few
entries, the same each start), and the request counters count its two requests. ``--skip-server-warmup`` turns
it off.
"""

from __future__ import annotations

import asyncio
import json
import logging

from mambaserve.server.cache.radix_tree import CacheBusyError

log = logging.getLogger(__name__)

PROMPT_TOKENS, NEW_TOKENS = 16, 4


def warm_up_prompt(vocab_size: int, context_length: int) -> tuple[list[int], int] | None:
    """(prompt ids, new tokens) of the warm-up requests, inside the model's vocabulary and the served context
    (``--context-length`` may be shorter than 16 + 4 tokens, a test model's vocabulary smaller than 17: a
    warm-up refused for either would stop a server that serves); None where the context holds no answer."""
    if context_length < 2:
        return None
    new = min(NEW_TOKENS, context_length - 1)  # decode steps first: the prompt is shortened before them
    n = min(PROMPT_TOKENS, context_length - new)
    return [(1 + i) % vocab_size for i in range(n)], new


async def request(app, path: str, body: dict, api_key: str | None = None) -> tuple[int, bytes]:
    """POST ``body`` to ``app`` in process, as uvicorn would pass a client's request: (status, answer)."""
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if api_key:
        headers.append((b"authorization", f"Bearer {api_key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent = False
    answer: dict = {"status": 0, "body": b""}

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected (the app watches for a disconnect)

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return answer["status"], answer["body"]


async def warm_up(app, engine, api_key: str | None = None) -> None:
    """Two generations through ``app`` at once, then the radix cache emptied; RuntimeError if one fails."""
    prompt = warm_up_prompt(engine.dims.vocab_size, engine.context_length)
    if prompt is None:
        log.info("warm-up skipped: a context of %d token(s) holds no answer", engine.context_length)
        return
    ids, new = prompt
    greedy = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0}}
    sampled = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0.8, "top_p": 0.9}}
    # beside them, the tokenizer's grammar form (0.4 s at a 50k vocabulary): the first structured request's
    grammar = asyncio.to_thread(engine.grammars.compile, "json_object", "")
    *answers, compiled = await asyncio.gather(request(app, "/generate", greedy, api_key),
                                              request(app, "/generate", sampled, api_key), grammar,
                                              return_exceptions=True)
    if isinstance(compiled, Exception):
        log.warning("warm-up: structured outputs will be refused: %s", compiled)
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
        status, body = answer
        if status != 200:
            raise RuntimeError(f"the server's warm-up request failed ({status}): {body[:300].decode(errors='replace')}")
    for _ in range(50):  # a host tier's snapshot still being written to storage holds the cache a moment
        try:
            await engine.flush_cache()
            break
        except CacheBusyError:
            await asyncio.sleep(0.02)
    else:
        log.info("warm-up: the radix cache stayed busy; its snapshot of the warm-up prompt stays cached")
    log.info("warm-up requests done")
