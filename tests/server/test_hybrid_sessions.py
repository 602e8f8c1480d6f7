"""Sessions of hybrid models with KV pages of 4 tokens: a streaming session holds its live state and its
KV pages between turns (the part the radix tree owns always page-aligned, its own pages from the page
after it, the partial last page its own), and gives exactly those back; non-streaming sessions branch
through the radix cache. Every output equals the history resent as one request to an engine without a
cache; the invariant check (slots and pages) runs after every step."""

import asyncio

import pytest

from mambaserve.server.engine.request import SamplingParams
from mambaserve.server.sessions.table import TurnParams
from tests.server.conftest import checked_accounting, make_engine, run_started


def _engine(path, **kw):
    return make_engine(path, **{**dict(context_length=512, page_size=4, chunked_prefill_size=6, max_running_requests=4, mamba_cache_size=12), **kw})



async def _gen(engine, ids, n, sid=None, **tp):
    out, lps, cached = [], [], None
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    async for o in engine.generate(ids, params, return_logprob=True, session_id=sid, turn_params=TurnParams(**tp)):
        assert o.error is None, o.error
        out += o.token_ids
        lps += o.logprobs
        cached = o.cached_tokens
    return out, lps, cached


def _words(n, seed):
    return [(seed * 13 + 5 * k * k + 3 * k) % 90 + 3 for k in range(n)]


def _resent(path, prompts_and_n):
    """Each prompt sent whole to an engine without a cache (sequentially: the same batch shapes as a session)."""
    cold = _engine(path, disable_radix_cache=True)

    async def go():
        return [await _gen(cold, p, n) for p, n in prompts_and_n]
    return run_started(cold, go)


def test_streaming_session_twenty_turns_page_size_4(nemotron):
    """Turns of 1 to 13 new tokens and 1 to 7 answer tokens: committed lengths fall anywhere in a page, and
    6-token prefill chunks split the longer turns. Each turn's output equals the whole history resent;
    each turn prefills only its new tokens; after close (and a flush of the cache) every page is free."""
    engine = _engine(nemotron)
    turns = [(_words(1 + (7 * i) % 13, i), 1 + (3 * i) % 7) for i in range(20)]

    async def go():
        sid = await engine.open_session(None, True, None, None)
        outs, held = [], []
        for new, n in turns:
            outs.append(await _gen(engine, new, n, sid))
            acct = checked_accounting(engine)
            held.append((acct["held_by_sessions"], acct["kv_pages"] - acct["kv_pages_free"] - acct["kv_pages_tree"]))
        await engine.close_session(sid)
        closed = checked_accounting(engine)
        await engine.flush_cache()
        return outs, held, closed, checked_accounting(engine)

    outs, held, closed, flushed = run_started(engine, go)
    history, prompts = [], []
    for (new, n), (out, _, _) in zip(turns, outs):
        history += new
        prompts.append((list(history), n))
        history += out
    ref = _resent(nemotron, prompts)
    before = 0
    for (out, lps, cached), (rout, rlps, _), (new, _) in zip(outs, ref, turns):
        assert out == rout
        assert lps == pytest.approx(rlps, abs=1e-4)
        assert cached == before  # the live state covered the whole history
        before += len(new) + len(out)
    history_len = 0
    for (new, _), (out, _, _), (slots, own_pages) in zip(turns, outs, held):
        history_len += len(new) + len(out)
        # between turns the session holds one slot and its own pages: those past the tree's page-aligned
        # prefix, up to the page holding its last token (nothing it reserved and did not write)
        assert slots == 1 and 0 < own_pages <= -(-history_len // 4)
    assert closed["held_by_sessions"] == 0 and closed["sessions"] == 0
    assert closed["kv_pages_free"] + closed["kv_pages_tree"] == closed["kv_pages"]
    assert flushed["kv_pages_free"] == flushed["kv_pages"] and flushed["free"] == flushed["capacity"]


def test_sessions_give_their_pages_up_under_pressure(nemotron):
    """Three streaming sessions and ordinary requests on a KV pool of two contexts of 64 tokens: requests that
    find no pages make idle sessions give their live state up (to the cache, or freed); those sessions'
    next turns start from the cache, and every output still equals the resent history."""
    engine = _engine(nemotron, context_length=64, max_total_tokens=128, mamba_cache_size=6, max_running_requests=3)
    plan = [[(_words(3 + (k + 2 * i) % 5, 10 * k + i), 2 + (k + i) % 3) for i in range(4)] for k in range(3)]
    others = [(_words(20 + 3 * i, 100 + i), 12) for i in range(6)]

    async def session(k):
        sid = await engine.open_session(None, True, None, None)
        outs = []
        for new, n in plan[k]:
            outs.append(await _gen(engine, new, n, sid))
            await asyncio.sleep(0)
        await engine.close_session(sid)
        return outs

    async def go():
        got = await asyncio.gather(*[session(k) for k in range(3)], *[_gen(engine, p, n) for p, n in others])
        return got, checked_accounting(engine)

    got, acct = run_started(engine, go)
    prompts = []
    for k in range(3):
        history = []
        for (new, n), (out, _, _) in zip(plan[k], got[k]):
            history += new
            prompts.append((list(history), n))
            history += out
    prompts += others
    ref = _resent(nemotron, prompts)
    mine = [o for k in range(3) for o in got[k]] + list(got[3:])
    assert [o[0] for o in mine] == [r[0] for r in ref]
    live = spilled = 0
    for k in range(3):
        before = 0
        for (new, _), (out, _, cached) in zip(plan[k], got[k]):
            live += before > 0 and cached == before
            spilled += cached < before  # its live state was given up: this turn started from the cache
            before += len(new) + len(out)
    assert live and spilled
    for (_, lps, _), (_, rlps, _) in zip(mine, ref):
        assert lps == pytest.approx(rlps, abs=1e-4)
    assert acct["running"] == acct["waiting"] == acct["sessions"] == acct["held_by_sessions"] == 0
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"] == 32
    assert acct["free"] + acct["held_by_tree"] == acct["capacity"]


def test_non_streaming_session_branches_through_the_cache(nemotron):
    """A branching session (turns from earlier turns, an offset, the previous output dropped) runs every
    turn as an ordinary request: outputs equal the resent prompts, and branches hit the cache."""
    engine = _engine(nemotron)

    async def go():
        sid = await engine.open_session(None, False, None, None)
        a = await _gen(engine, _words(17, 1), 5, sid, rid=None)
        ra = engine.scheduler.sessions.table.get(sid).last_rid
        b = await _gen(engine, _words(6, 2), 4, sid)
        c = await _gen(engine, _words(9, 3), 4, sid, rid=ra, offset=12)
        d = await _gen(engine, _words(5, 4), 3, sid, rid=ra, drop_previous_output=True)
        await engine.close_session(sid)
        return [a, b, c, d], checked_accounting(engine)

    (a, b, c, d), acct = run_started(engine, go)
    p_a = _words(17, 1)
    prompts = [(p_a, 5), (p_a + a[0] + _words(6, 2), 4), ((p_a + a[0])[:12] + _words(9, 3), 4),
               (p_a + _words(5, 4), 3)]
    ref = _resent(nemotron, prompts)
    for (out, lps, _), (rout, rlps, _) in zip([a, b, c, d], ref):
        assert out == rout
        assert lps == pytest.approx(rlps, abs=1e-4)
    assert b[2] >= 16 and c[2] == 12 and d[2] >= 16  # page-aligned prefixes of turn a from the cache
    assert acct["sessions"] == 0 and acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"]


def test_timeout_and_the_held_slot_bound_release_exactly_what_sessions_hold(nemotron):
    """Sessions may hold one slot between turns (--session-slot-fraction): a second session's turn end makes
    the first give its live state and pages up; a session past its timeout is reaped. Outputs equal the
    resent history; afterwards no page is held outside the tree."""
    engine = _engine(nemotron, session_slot_fraction=0.1)  # 12 slots: one for sessions

    async def go():
        a = await engine.open_session(None, True, None, None)
        b = await engine.open_session(None, True, 0.6, None)
        outs = [await _gen(engine, _words(9, 1), 4, a), await _gen(engine, _words(7, 2), 3, b),
                await _gen(engine, _words(5, 3), 3, a)]
        mid = checked_accounting(engine)
        await asyncio.sleep(1.5)  # b idles past its timeout (the scheduler reaps twice a second)
        reaped = checked_accounting(engine)
        await engine.close_session(a)
        return outs, mid, reaped, checked_accounting(engine)

    outs, mid, reaped, closed = run_started(engine, go)
    pa = _words(9, 1)
    ref = _resent(nemotron, [(pa, 4), (_words(7, 2), 3), (pa + outs[0][0] + _words(5, 3), 3)])
    assert [o[0] for o in outs] == [r[0] for r in ref]
    # a gave its live state (13 tokens: not on a page, so freed with its pages) up when b's turn ended: its
    # next turn hit the snapshot of its first prompt minus its last token (8 tokens, 2 pages)
    assert outs[2][2] == 8
    assert mid["held_by_sessions"] == 1 and mid["sessions"] == 2
    assert reaped["sessions"] == 1 and reaped["held_by_sessions"] == 1
    assert closed["sessions"] == closed["held_by_sessions"] == 0
    assert closed["kv_pages_free"] + closed["kv_pages_tree"] == closed["kv_pages"]


def test_a_hybrid_session_file_keeps_its_tokens_and_the_restored_session_goes_on(nemotron, tmp_path):
    """A hybrid session's snapshot file holds its tokens only (its KV stays on the device): restored, its next
    turn prefills the history through the cache and answers as the resent history does."""
    engine = _engine(nemotron, session_snapshot_dir=str(tmp_path))

    async def go():
        sid = await engine.open_session(None, True, None, None)
        first = await _gen(engine, _words(10, 1), 5, sid)
        saved = await engine.snapshot_session(sid, None)
        await engine.close_session(sid)
        restored = await engine.restore_session(saved["name"], "again")
        second = await _gen(engine, _words(4, 2), 4, "again")
        await engine.close_session("again")
        return first, saved, restored, second, checked_accounting(engine)

    first, saved, restored, second, acct = run_started(engine, go)
    history = _words(10, 1) + first[0] + _words(4, 2)
    (ref,) = _resent(nemotron, [(history, 4)])
    assert saved["has_state"] is False and saved["tokens"] == 15
    assert restored == {"session_id": "again", "tokens": 15, "has_state": False}
    assert second[0] == ref[0] and second[1] == pytest.approx(ref[1], abs=1e-4)
    assert 0 < second[2] < 15  # from the cache: the first prompt's last page boundary (its state is not on one)
    assert acct["sessions"] == 0 and acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"]
