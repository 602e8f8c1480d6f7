"""mambaserve workers behind the real sglang-router (the Rust gateway from PyPI), policy ``manual``.

The router drops ``session_id`` and the ``x-session-id`` header and does not proxy ``/open_session``
or ``/close_session``; it forwards ``session_params`` and the ``x-smg-routing-key`` header, by which
``manual`` pins a key to one worker. Sessions therefore go through it as: ``session_params`` in the
body (``open`` on the first turn, ``close`` on the last) and the session id as the routing key.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass

import httpx
import pytest

from tests.server.conftest import make_engine, run, serving, sglang_router, uvicorn_server

GREEDY = {"temperature": 0, "ignore_eos": True}


@dataclass
class Routed:
    url: str
    metrics_url: str
    engines: list
    worker_urls: list[str]


@pytest.fixture(scope="module")
def routed(tiny_ckpt):
    engines = [make_engine(tiny_ckpt, context_length=4096) for _ in range(2)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(uvicorn_server(e)) for e in engines]
        url, metrics = stack.enter_context(sglang_router(urls, "--policy", "manual", "--assignment-mode", "min_group"))
        yield Routed(url, metrics, engines, urls)


def _sessions_on(engine) -> set[str]:
    return set(engine.scheduler.call(lambda: list(engine.scheduler.sessions.table.sessions)).result(timeout=10))


def _words(n, seed):
    return [(seed * 17 + 7 * k * k + k) % 90 + 3 for k in range(n)]


def _unpack(r):
    assert r.status_code == 200, r.text
    b = r.json()
    return b["output_ids"], [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]


def _router_metric(text: str, name: str, worker: str) -> float:
    m = re.search(rf'^{name}\{{[^}}]*worker="{re.escape(worker)}"[^}}]*\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_sessions_through_the_router_keep_history_on_one_worker(routed, tiny_ckpt):
    turns = {f"conv-{k}": [_words(3 + (k + i) % 6, 10 * k + i) for i in range(4)] for k in range(4)}

    async def conversation(c, sid, inputs, placements):
        outs = []
        for i, ids in enumerate(inputs):
            sp = {"id": sid, **({"open": True, "streaming": k_streaming(sid)} if i == 0 else {}),
                  **({"close": True} if i == len(inputs) - 1 else {})}
            r = await c.post("/generate", headers={"x-smg-routing-key": sid},
                             json={"input_ids": ids, "session_params": sp, "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": 4, **GREEDY}})
            outs.append(_unpack(r))
            if i < len(inputs) - 1:  # open between turns: on exactly one worker
                placements.append(tuple(sid in _sessions_on(e) for e in routed.engines))
        return outs

    def k_streaming(sid):  # both kinds of session: live state (streaming) and through the radix cache
        return int(sid.rsplit("-", 1)[1]) % 2 == 0

    async def throughsglang_router():
        async with httpx.AsyncClient(base_url=routed.url, timeout=60) as c:
            placements = {sid: [] for sid in turns}
            got = await asyncio.gather(*(conversation(c, sid, t, placements[sid]) for sid, t in turns.items()))
            return dict(zip(turns, got)), placements

    cold = make_engine(tiny_ckpt, disable_radix_cache=True, context_length=4096)

    async def resent():
        async with serving(cold) as c:
            ref = {}
            for sid, inputs in turns.items():
                history, ref[sid] = [], []
                for ids in inputs:
                    history += ids
                    r = await c.post("/generate", json={"input_ids": history, "return_logprob": True,
                                                        "sampling_params": {"max_new_tokens": 4, **GREEDY}})
                    out = _unpack(r)
                    history += out[0]
                    ref[sid].append(out)
            return ref

    got, placements = run(throughsglang_router())
    ref = run(resent())
    for sid in turns:
        for (ids, lps), (rids, rlps) in zip(got[sid], ref[sid]):
            assert ids == rids, sid
            assert lps == pytest.approx(rlps, abs=1e-5)
        assert len(set(placements[sid])) == 1 and sum(placements[sid][0]) == 1, (sid, placements[sid])
    assert {placements[sid][0].index(True) for sid in turns} == {0, 1}  # min_group spread them over both
    assert all(not _sessions_on(e) for e in routed.engines)  # each closed by its last turn

    metrics = httpx.get(routed.metrics_url).text
    for w in routed.worker_urls:
        assert _router_metric(metrics, "smg_worker_cb_state", w) == 0  # closed
        assert _router_metric(metrics, "smg_worker_cb_consecutive_failures", w) == 0


def test_openai_requests_without_a_model_and_chat_sessions_through_thesglang_router(routed):
    async def go():
        async with httpx.AsyncClient(base_url=routed.url, timeout=60) as c:
            listed = (await c.get("/v1/models")).json()["data"][0]["id"]  # the id the router lists
            comp = await c.post("/v1/completions", json={"model": listed, "prompt": "def f(", "max_tokens": 3,
                                                         "temperature": 0})
            plain = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})
            gen = await c.post("/generate", json={"text": "import os", "sampling_params": {"max_new_tokens": 3}})
            h = {"x-smg-routing-key": "chat-1"}  # the session's id too: session_params names none
            msg = lambda t: [{"role": "user", "content": t}]  # noqa: E731
            a = await c.post("/v1/chat/completions", headers=h, json={
                "messages": msg("hi"), "max_tokens": 3, "temperature": 0,
                "session_params": {"open": True, "streaming": True}})
            on = [_sessions_on(e) for e in routed.engines]
            b = await c.post("/v1/chat/completions", headers=h, json={
                "messages": msg("more"), "max_tokens": 3, "temperature": 0, "session_params": {"close": True}})
            return listed, comp, plain, gen, a, b, on

    listed, comp, plain, gen, a, b, on = run(go())
    assert sorted(on, key=len) == [set(), {"chat-1"}]
    assert listed == "tiny"
    for r in (comp, plain, gen, a, b):
        assert r.status_code == 200, r.text
    a, b = a.json()["usage"], b.json()["usage"]
    # the second turn runs on the first turn's live state: everything before it is cached
    assert b["prompt_tokens_details"]["cached_tokens"] == a["prompt_tokens"] + a["completion_tokens"]
    assert all(not _sessions_on(e) for e in routed.engines)
    metrics = httpx.get(routed.metrics_url).text
    assert all(_router_metric(metrics, "smg_worker_cb_state", w) == 0 for w in routed.worker_urls)


def test_the_router_reads_each_workers_load(routed):
    """``/get_load`` in SGLang's shape: the router's load monitor (policy power_of_two) and its own
    ``/get_loads`` read it; without it they saw -1 for every worker."""
    busy, idle = routed.worker_urls

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            long = asyncio.ensure_future(c.post(busy + "/generate", json={
                "input_ids": _words(9, 1), "rid": "long-1",
                "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}))
            while (await c.get(busy + "/get_load")).json()[0]["num_reqs"] == 0:
                await asyncio.sleep(0.02)
            loads = {w["worker"]: w["load"] for w in (await c.get(routed.url + "/get_loads")).json()["workers"]}
            direct = (await c.get(busy + "/get_load")).json()
            await c.post(busy + "/abort_request", json={"rid": "long-1"})
            await long
            return loads, direct, (await c.get(busy + "/get_load")).json()

    loads, direct, after = run(go())
    assert loads[busy] > 9 and loads[idle] == 0  # the running request's prompt and output so far
    assert direct[0]["num_reqs"] == 1 and direct[0]["dp_rank"] == 0
    assert after == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def _served(urls: list[str]) -> list[float]:
    """Requests each worker has finished (its mambaserve_requests_total, all reasons)."""
    return [sum(float(line.split()[-1]) for line in httpx.get(u + "/metrics").text.splitlines()
                if line.startswith("mambaserve_requests_total{")) for u in urls]


def test_how_cache_aware_spreads_requests_over_workers(routed):
    """What policy cache_aware (sglang-router 0.3.2) does with mambaserve workers, as docs/server-interface.md
    explains: a request whose text shares a long prefix with one the router sent to a worker goes there
    (affinity, until that worker has 64 more requests in flight than the other); any other request goes to
    the worker with the fewest requests in flight, ties always to the same one. So one request at a time,
    everything lands on one worker (the report in issue 20); concurrent traffic spreads."""

    async def burst(url, prompts, concurrency):
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async def one(text):
                async with sem:
                    r = await c.post("/generate", json={"text": text, "sampling_params": {
                        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}})
                    assert r.status_code == 200, r.text
            await asyncio.gather(*(one(t) for t in prompts))

    def spread(url, prompts, concurrency):
        before = _served(routed.worker_urls)
        run(burst(url, prompts, concurrency))
        return sorted(a - b for a, b in zip(_served(routed.worker_urls), before))

    distinct = lambda k, tag: [f"{chr(65 + i % 26)}{tag}{i} " * 8 for i in range(k)]  # noqa: E731
    shared = "def handler(request, response):\n    " * 4
    with sglang_router(routed.worker_urls, "--policy", "cache_aware") as (url, _):
        one_at_a_time = spread(url, distinct(8, "s"), 1)
        concurrent = spread(url, distinct(16, "c"), 8)
        same_prefix = spread(url, [shared + f"x{i}" for i in range(12)], 6)
    assert one_at_a_time == [0, 8]
    assert concurrent[0] >= 4 and sum(concurrent) == 16
    assert same_prefix == [0, 12]



def test_a_new_worker_takes_new_sessions_while_the_old_ones_stay(tiny_ckpt):
    """Scale 1 -> 2 under load, as the operator's router runs (manual + min_group; the new pod discovered
    while sessions run, here added through the router's POST /workers). min_group gives a new key the worker
    with the fewest keys *in flight* (ties at random): while the old sessions' turns run on the first worker,
    every session opened goes to the new one; the old sessions stay where their state is."""
    engines = [make_engine(tiny_ckpt, context_length=4096) for _ in range(2)]
    old, new = [f"old-{k}" for k in range(3)], [f"new-{k}" for k in range(3)]

    async def turn(c, sid, i, n=3, close=False):
        sp = {"id": sid, **({"open": True, "streaming": True} if i == 0 else {}), **({"close": True} if close else {})}
        r = await c.post("/generate", headers={"x-smg-routing-key": sid},
                         json={"input_ids": _words(4, 3 * i + len(sid)), "session_params": sp,
                               "sampling_params": {"max_new_tokens": n, **GREEDY}})
        assert r.status_code == 200, (sid, i, r.text)
        return r.json()["meta_info"]["cached_tokens"]

    def placed(sid):
        return tuple(sid in _sessions_on(e) for e in engines)

    async def go(url, first, second):
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            for sid in old:
                await turn(c, sid, 0)  # opened while there is one worker
            # The load: a long turn of every old session in flight on the first worker.
            running = [asyncio.ensure_future(turn(c, sid, 1, n=3500)) for sid in old]
            while (await c.get(first + "/get_load")).json()[0]["num_reqs"] < len(old):
                await asyncio.sleep(0.02)
            assert (await c.post("/workers", json={"url": second})).status_code == 202
            while len([w for w in (await c.get("/workers")).json()["workers"] if w["is_healthy"]]) < 2:
                await asyncio.sleep(0.05)
            where = {}
            for sid in new:
                await turn(c, sid, 0)
                where[sid] = placed(sid)
            busy = sum(not f.done() for f in running)  # still in flight when the last new key was placed
            cached = await asyncio.gather(*running)
            for sid in old:  # their next turns: on the first worker, on their live state
                cached.append(await turn(c, sid, 2))
                where[sid] = placed(sid)
            for sid in old + new:
                await turn(c, sid, 3, close=True)
            return where, busy, cached

    with contextlib.ExitStack() as stack:
        first, second = [stack.enter_context(uvicorn_server(e)) for e in engines]
        url, _ = stack.enter_context(sglang_router([first], "--policy", "manual", "--assignment-mode", "min_group"))
        where, busy, cached = run(go(url, first, second))
        assert all(not _sessions_on(e) for e in engines)  # each closed by its last turn
    assert busy == len(old), "the old turns ended before the new sessions were placed: no load to balance against"
    assert {where[sid] for sid in new} == {(False, True)}, where  # the new worker had no key in flight
    assert {where[sid] for sid in old} == {(True, False)}, where
    assert all(c > 0 for c in cached), cached  # a turn sent elsewhere would have been a 404, not recomputed
