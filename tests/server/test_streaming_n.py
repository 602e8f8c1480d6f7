"""Streaming with n > 1 (and batches on /generate): chunks carry their choice's index, every choice
ends with its own finish_reason, the streamed answers equal the non-streamed ones, and a client that
goes away aborts every choice."""

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import accounting, assert_idle, make_engine, run, serving, uvicorn_server

PROMPT = [(7 * k + 3) % 90 + 2 for k in range(21)]
SEEDED = {"temperature": 1.0, "seed": 11}


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt, max_running_requests=8, mamba_cache_size=12, context_length=8192)


def _events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _counts(usage):
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}  # (the second run hits the cache)


def _per_choice(chunks, field):
    """{index: (joined field, finish reasons in order)} from OpenAI chunks."""
    got: dict[int, list] = {}
    for ev in chunks:
        for ch in ev["choices"]:
            text, reasons = got.setdefault(ch["index"], ["", []])
            got[ch["index"]][0] = text + field(ch)
            reasons.append(ch["finish_reason"])
    return got


def test_streamed_choices_equal_the_non_streamed_answers(engine):
    comp = {"prompt": PROMPT, "n": 3, "max_tokens": 12, **SEEDED, "stop_token_ids": [40, 41, 42, 43]}
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 6, **SEEDED}
    native = {"input_ids": [PROMPT, PROMPT[:9]], "sampling_params": {"n": 2, "max_new_tokens": 10, **SEEDED}}

    async def go():
        async with serving(engine) as c:
            r = {}
            for path, body in (("/v1/completions", comp), ("/v1/chat/completions", chat), ("/generate", native)):
                whole = await c.post(path, json=body)
                streamed = await c.post(path, json={**body, "stream": True,
                                                    "stream_options": {"include_usage": True}})
                assert whole.status_code == streamed.status_code == 200, streamed.text
                r[path] = whole.json(), _events(streamed.text)
            return r, await accounting(engine)

    r, acc = run(go())
    whole, events = r["/v1/completions"]
    assert events[-1] == "[DONE]" and _counts(events[-2]["usage"]) == _counts(whole["usage"])
    got = _per_choice(events[:-2], lambda ch: ch["text"])
    assert sorted(got) == [0, 1, 2]
    for ch in whole["choices"]:
        text, reasons = got[ch["index"]]
        assert text == ch["text"]
        assert reasons[-1] == ch["finish_reason"] and all(x is None for x in reasons[:-1])  # finished once, last
    assert len({ch["text"] for ch in whole["choices"]}) > 1  # distinct answers (seed + i)

    whole, events = r["/v1/chat/completions"]
    assert _counts(events[-2]["usage"]) == _counts(whole["usage"])
    got = _per_choice(events[:-2], lambda ch: ch["delta"].get("content", ""))
    for ch in whole["choices"]:
        assert got[ch["index"]][0] == ch["message"]["content"]
        assert got[ch["index"]][1][-1] == ch["finish_reason"]
    firsts = {}
    for ev in events[:-2]:
        for ch in ev["choices"]:
            firsts.setdefault(ch["index"], ch["delta"])
    assert all(d.get("role") == "assistant" for d in firsts.values()) and len(firsts) == 2

    whole, events = r["/generate"]  # cumulative answers, each with its index: the last per index is whole
    last = {}
    for ev in events[:-1]:
        last[ev["index"]] = ev
    assert sorted(last) == [0, 1, 2, 3]
    for i, answer in enumerate(whole):
        assert last[i]["output_ids"] == answer["output_ids"] and last[i]["text"] == answer["text"]
        assert last[i]["meta_info"]["finish_reason"] == answer["meta_info"]["finish_reason"]
    assert_idle(acc)


def test_a_client_that_goes_away_aborts_every_choice(engine):
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}

    def aborts(text):
        return float(next((line.split()[-1] for line in text.splitlines()
                           if line.startswith('mambaserve_requests_total{finish_reason="abort"}')), 0))

    with uvicorn_server(engine) as url:
        async def go():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                before = aborts((await c.get("/metrics")).text)
                seen = set()
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            seen.update(ch["index"] for ch in json.loads(line[6:])["choices"])
                            if len(seen) == 3:
                                break  # every choice is running: leave mid-stream
                acc = await accounting(engine)
                return before, aborts((await c.get("/metrics")).text), acc

        before, after, acc = run(go())
    assert after == before + 3
    assert_idle(acc)


def test_a_refused_choice_refuses_the_stream_and_runs_nothing(engine):
    async def go():
        async with serving(engine) as c:
            r = await c.post("/generate", json={"input_ids": [PROMPT, [10 ** 6]], "stream": True,
                                                "sampling_params": {"n": 2}})
            return r, await accounting(engine)

    r, acc = run(go())
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    assert_idle(acc)
