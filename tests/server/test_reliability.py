"""Ordinary traffic must never wedge the server: long conversations against a small pool, many streaming
sessions. Every request finishes (bounded by a timeout), outputs equal a cacheless engine's, and
the debug invariant check (progress included) runs after every step."""

import asyncio

import pytest

from tests.server.conftest import accounting, assert_idle, make_engine, run, serving

GREEDY = {"temperature": 0, "ignore_eos": True}


def _words(n, seed):
    return [(seed * 17 + 3 * k * k + k) % 94 + 1 for k in range(n)]


async def _generate(c, ids, n=5, session=None):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}}
    if session:
        body["session_params"] = {"id": session}
    r = await asyncio.wait_for(c.post("/generate", json=body), timeout=30)  # a wedge fails here, not in CI
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"]


@pytest.fixture(scope="module")
def cold(tiny_ckpt):
    return make_engine(tiny_ckpt, disable_radix_cache=True, context_length=4096)


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_a_long_conversation_resent_each_turn_never_wedges(tiny_ckpt, cold, slots):
    """Every evictable snapshot lies on the path a turn's hit locks (chunk-end donations fill the pool
    with the conversation's own prefixes): the hit takes the matched snapshot's slot over instead of
    waiting for a slot forever."""
    engine = make_engine(tiny_ckpt, mamba_cache_size=slots, chunked_prefill_size=16, context_length=4096)

    async def conversation(e):
        async with serving(e) as c:
            history, outs, cached = [5, 6, 7], [], []
            for turn in range(24):
                history = history + _words(11, turn)
                ids, hit = await _generate(c, history)
                history = history + ids
                outs.append(ids)
                cached.append(hit)
            return outs, cached, await accounting(e)

    outs, cached, acc = run(conversation(engine))
    ref, _, _ = run(conversation(cold))
    assert outs == ref
    assert sum(h > 0 for h in cached) >= 20  # and the history keeps hitting
    assert_idle(acc)


def test_streaming_sessions_hold_a_bounded_share_of_the_pool(tiny_ckpt, cold):
    """Twelve streaming sessions on an 8-slot pool: they hold at most half of it between turns; plain
    requests are served meanwhile; a session that gave its state up continues exactly, from the cache
    while its snapshot lasts, else by prefilling its history again."""
    engine = make_engine(tiny_ckpt, mamba_cache_size=8, context_length=4096)
    first = [_words(9, i) for i in range(12)]
    second = _words(6, 99)

    async def go():
        async with serving(engine) as c:
            sids = [(await c.post("/open_session", json={"streaming": True})).json() for _ in first]
            answers = [(await _generate(c, t, session=sid))[0] for sid, t in zip(sids, first)]
            held = (await c.get("/get_server_info")).json()["internal_states"][0]["held_by_sessions"]
            recent = await _generate(c, second, session=sids[7])  # gave its state up last: still cached
            plain = await asyncio.gather(*(_generate(c, _words(20, 50 + i)) for i in range(6)))
            oldest = await _generate(c, second, session=sids[0])
            for sid in sids:
                await c.post("/close_session", json={"session_id": sid})
            return answers, held, recent, plain, oldest, await accounting(engine)

    answers, held, recent, plain, oldest, acc = run(go())
    assert held == 4
    assert len(plain) == 6

    async def resend(i):
        async with serving(cold) as c:
            return (await _generate(c, first[i] + answers[i] + second))[0]

    assert recent == (run(resend(7)), len(first[7]) + len(answers[7]))
    assert oldest[0] == run(resend(0))
    assert_idle(acc)
