"""Edge cases of the hybrid radix cache through the engine (a review's probes): prompt lengths around
page boundaries, max_new_tokens 0 and 1, page size 1, several answers to one prompt, prompt logprobs,
aborts at every stage and flush_cache with an idle streaming session. Every request gives the cold
engine's outputs; after each the invariant check (slots and pages) passes and nothing leaks."""

import asyncio
import random

import pytest

from mambaserve.server.engine.request import SamplingParams
from tests.server.conftest import make_engine, run_started


def _engine(path, **kw):
    return make_engine(path, **{**dict(context_length=128, page_size=4, chunked_prefill_size=8, max_running_requests=4, mamba_cache_size=12), **kw})



def _words(n, seed):
    return [(seed * 17 + 3 * k * k + 5 * k) % 91 + 2 for k in range(n)]


async def _one(engine, prompt, n, **kw):
    ids, lps, cached, inp = [], [], None, None
    async for o in engine.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                                   return_logprob=True, **kw):
        assert o.error is None, o.error
        ids += o.token_ids
        lps += o.logprobs
        cached = o.cached_tokens
        inp = o.input_logprobs if o.input_logprobs is not None else inp
    return ids, lps, cached, inp


def _idle(engine):
    engine.scheduler.call(engine.scheduler.check_invariants).result(timeout=10)
    acct = engine.scheduler.call(engine.scheduler.accounting).result(timeout=10)
    assert acct["running"] == acct["waiting"] == 0
    assert acct["free"] + acct["held_by_tree"] + acct["held_by_sessions"] == acct["capacity"], acct
    return acct


def _sweep(engine, jobs):
    async def go():
        out = []
        for p, n in jobs:
            out.append(await _one(engine, p, n))
            _idle(engine)
        return out
    return run_started(engine, go)


@pytest.mark.parametrize("page_size,overlap,chunk", [(4, True, 8), (4, False, 8), (1, True, 8), (4, True, 3),
                                                     (16, True, 5)])
def test_prompts_around_page_boundaries_and_tiny_answers(nemotron, page_size, overlap, chunk):
    """Prompts of 1 to 13 tokens (shorter than a page, a page multiple, one past it) with 0, 1 or 3 new
    tokens, each sent twice: the second hits where the first left a page-aligned snapshot. Prefill chunks
    of two pages, or shorter than a page."""
    jobs = [(_words(L, L), n) for L in (1, 2, 3, 4, 5, 8, 9, 12, 13) for n in (0, 1, 3)]
    jobs = [j for j in jobs for _ in range(2)]
    kw = dict(page_size=page_size, disable_overlap_schedule=not overlap, chunked_prefill_size=chunk)
    warm = _engine(nemotron, **kw)
    got = _sweep(warm, jobs)
    ref = _sweep(_engine(nemotron, disable_radix_cache=True, **kw), jobs)
    for (p, n), g, r in zip(jobs, got, ref):
        assert g[0] == r[0], (len(p), n)
        assert g[1] == pytest.approx(r[1], abs=1e-4)
        assert len(g[0]) == n
    acct = warm.scheduler.accounting()
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"]
    if page_size < 16:
        assert sum(1 for g in got if g[2]) >= 9  # resent prompts past a page hit


def test_several_answers_and_prompt_logprobs(nemotron):
    """generate_n over prompts ending anywhere in a page, and prompt logprobs from positions around page
    boundaries (the match stops before them): the cold engine's numbers."""
    def go(engine):
        async def run():
            out = []
            for L in (9, 10, 13):
                p = _words(L, 40 + L)
                params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
                gens = engine.generate_n(p, params, 3, return_logprob=True)
                for g in gens:
                    toks = []
                    async for o in g:
                        assert o.error is None, o.error
                        toks += o.token_ids
                    out.append(toks)
                _idle(engine)
            for start in (0, 3, 4, 5, 8, 12):
                p = _words(13, 7)
                out.append(await _one(engine, p, 2, logprob_start_len=start))
                out.append(await _one(engine, p, 2, logprob_start_len=start))
                _idle(engine)
            return out
        return run
    warm = _engine(nemotron)
    got = run_started(warm, go(warm))
    cold = _engine(nemotron, disable_radix_cache=True)
    ref = run_started(cold, go(cold))
    for g, r in zip(got, ref):
        if isinstance(g, list):
            assert g == r
        else:
            assert g[0] == r[0]
            assert g[1] == pytest.approx(r[1], abs=1e-4)
            assert g[3] == pytest.approx(r[3], abs=1e-4)


def test_flush_cache_with_an_idle_streaming_session(nemotron):
    """An idle streaming session pins the page-aligned prefix of its history in the tree: flush_cache
    empties the rest of the cache instead of refusing, the session goes on with the cold outputs, and
    after it closes every page is free."""
    engine = _engine(nemotron)

    async def go():
        sid = await engine.open_session(None, True, None, None)
        a = await _one(engine, _words(11, 1), 4, session_id=sid)
        await _one(engine, _words(13, 2), 3)  # another prompt's pages in the tree
        freed = await engine.flush_cache()
        acct = _idle(engine)
        b = await _one(engine, _words(6, 3), 4, session_id=sid)
        await engine.close_session(sid)
        await engine.flush_cache()
        return a, b, freed, acct, _idle(engine)

    a, b, freed, acct, end = run_started(engine, go)
    cold = _engine(nemotron, disable_radix_cache=True)
    ref = run_started(cold, lambda: _cold_history(cold, [(_words(11, 1), 4), (_words(6, 3), 4)]))
    assert [a[0], b[0]] == ref
    assert freed > 0
    assert acct["held_by_sessions"] == 1 and acct["held_by_tree"] == 0
    # what stays in the tree is the session's page-aligned prefix (a chunk ended at 8), pinned
    assert acct["kv_pages_tree"] == 2 and acct["kv_pages_evictable"] == 0
    assert end["kv_pages_free"] == end["kv_pages"] and end["free"] == end["capacity"]


async def _cold_history(engine, turns):
    history, outs = [], []
    for new, n in turns:
        history += new
        ids = (await _one(engine, history, n))[0]
        history += ids
        outs.append(ids)
    return outs


def _settle(sched, limit=200):
    for _ in range(limit):
        sched._drain_inbox(block=False)
        if not (sched.queues.running or sched.queues.waiting or sched.inflight):
            return
        sched.step()
    raise AssertionError("the scheduler did not go idle")


@pytest.mark.parametrize("overlap", [True, False])
def test_aborts_and_session_closes_at_every_step_leak_nothing(nemotron, overlap):
    """The scheduler stepped by hand: a request of 21 tokens (chunks of 8, pages of 4), a second sharing
    its first 16 tokens and a streaming session's second turn run together; after k steps (0 to 15: queued,
    mid-prefill, mid-decode, answered, folding) one of them is aborted, or all time out, and the session
    closed. Some of those cuts come while a request holds a rolling decode snapshot. The
    invariant check runs after every step; once idle (sessions closed, cache flushed) every page and slot
    is free."""
    engine = _engine(nemotron, disable_overlap_schedule=not overlap, max_running_requests=3)
    sched = engine.scheduler
    params = lambda n: SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    a_prompt = _words(21, 1)
    rolling = []  # rolling snapshots held when the cut came

    async def scenario(k, action):
        sid = sched.sessions.open(None, True, None, None)
        first = engine.generate(_words(9, 2), params(3), session_id=sid)
        _settle(sched)
        a = engine.generate(a_prompt, params(6))
        b = engine.generate(a_prompt[:16] + _words(3, 3), params(3))
        turn = engine.generate(_words(6, 4), params(4), session_id=sid)
        for _ in range(k):
            sched._drain_inbox(block=False)
            sched.step()
        rolling.append(len(sched.rolling))
        if action < 3:
            sched._abort((a, b, turn)[action].req.rid)
        else:  # every request past --request-timeout
            sched.request_timeout, sched._next_reap = 1e-9, 0.0
            sched._reap()
            sched.request_timeout = 0
        sched.sessions.close(sid)
        sched.check_invariants()
        _settle(sched)
        sched.check_invariants()
        acct = sched.accounting()
        assert acct["held_by_sessions"] == 0 and acct["sessions"] == 0
        assert acct["kv_pages_evictable"] == acct["kv_pages_tree"], (k, action, acct)
        sched.flush_cache()
        acct = sched.accounting()
        assert acct["free"] == acct["capacity"] and acct["kv_pages_free"] == acct["kv_pages"], (k, action, acct)
        del first

    async def go():
        for k in range(16):
            await scenario(k, k % 4)
    asyncio.run(go())
    assert any(rolling), rolling


@pytest.mark.parametrize("overlap", [True, False])
def test_a_one_token_session_turn_with_nothing_to_generate(nemotron, overlap):
    """A streaming turn of one new token with max_new_tokens 0 starts from the live state with only that
    token left: it answers no token (it sampled one), folds the token into the live state, and the
    session goes on with the cold engine's outputs; a history of 15 tokens + 1 puts the token on a page's
    last position (no decode row may run past the pages the turn reserved)."""
    engine = _engine(nemotron, disable_overlap_schedule=not overlap)
    turns = [(_words(9, 1), 6), (_words(1, 2), 0), (_words(2, 3), 0), (_words(1, 4), 2)]

    async def go():
        sid = await engine.open_session(None, True, None, None)
        out = []
        for new, n in turns:
            out.append(await _one(engine, new, n, session_id=sid))
            acct = _idle(engine)
        await engine.close_session(sid)
        return out, acct

    out, acct = run_started(engine, go)
    assert [len(o[0]) for o in out] == [n for _, n in turns]
    assert [o[2] for o in out[1:]] == [15, 16, 18]  # every turn continued from the live state
    assert acct["held_by_sessions"] == 1
    cold = _engine(nemotron, disable_radix_cache=True)
    assert [o[0] for o in out] == run_started(cold, lambda: _cold_history(cold, turns))


async def _prompt_logprobs(engine, new, start, **kw):
    inp, ids = None, None
    async for o in engine.generate(new, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True),
                                   return_logprob=True, logprob_start_len=start, **kw):
        assert o.error is None, o.error
        if o.input_logprobs is not None:
            inp, ids = o.input_logprobs, o.input_token_ids
    return inp, ids


@pytest.mark.parametrize("model", ["nemotron", "tiny_ckpt"])
def test_prompt_logprobs_of_a_streaming_turn_before_its_live_state(request, model):
    """A streaming turn asking for prompt logprobs from a position its live state already covers gets one
    per prompt token from there (the session's state goes to the cache and the turn runs those
    positions), the cold engine's values; the session goes on from its live state afterwards. The same
    on a pure Mamba2 model (page size 1)."""
    path = request.getfixturevalue(model)
    kw = {} if model == "nemotron" else {"page_size": 1}
    engine = _engine(path, **kw)
    turns = [(_words(9, 1), -1), (_words(5, 2), 2), (_words(5, 3), 14), (_words(3, 4), 30)]

    async def go():
        sid = await engine.open_session(None, True, None, None)
        out = []
        for new, start in turns:
            out.append(await _prompt_logprobs(engine, new, start, session_id=sid))
            _idle(engine)
        return out

    got = run_started(engine, go)
    cold = _engine(path, disable_radix_cache=True, **kw)

    async def ref():
        history, out = [], []
        for new, start in turns:
            history += new
            out.append(await _prompt_logprobs(cold, history, start))
            history += (await _one(cold, history, 2))[0]
        return out

    want = run_started(cold, ref)
    for (inp, ids), (rinp, rids), (_, start) in zip(got, want, turns):
        assert ids == rids
        if start >= 0:
            assert len(inp) == len(ids)
            assert inp[start == 0:] == pytest.approx(rinp[start == 0:], abs=1e-4)


@pytest.mark.parametrize("page_size,chunk,overlap", [(4, 6, True), (16, 5, True), (1, 7, False), (4, 3, False)])
def test_sessions_and_traffic_with_aborts_under_pressure(nemotron, page_size, chunk, overlap):
    """Four streaming sessions (turns of 1 to 8 tokens, 0 to 4 answer tokens, some cut off by the client,
    some with prompt logprobs) beside twelve requests sharing prefixes, on 5 state slots and 3 contexts
    of KV pages. The interleavings vary with timing; for every one no request fails, and once the
    sessions close and the cache is flushed every slot and page is free."""
    rng = random.Random(page_size * 100 + chunk)
    engine = _engine(nemotron, page_size=page_size, chunked_prefill_size=chunk, context_length=64,
                     max_total_tokens=64 * 3, mamba_cache_size=5, max_running_requests=3,
                     disable_overlap_schedule=not overlap, session_slot_fraction=0.5)
    errors, done = [], []

    async def one(ids, n, sid=None, cut=None):
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        gen = engine.generate(ids, params, session_id=sid, return_logprob=rng.random() < 0.2,
                              logprob_start_len=rng.choice([-1, 0, 3, 9]))
        async for k, o in _enumerate(gen):
            errors.extend([o.error] if o.error else [])
            done.extend([o] if o.finish_reason is not None else [])
            if cut is not None and k + 1 >= cut:
                await gen.aclose()
                break

    async def session(i):
        sid = await engine.open_session(None, True, None, None)
        for t in range(rng.randrange(2, 7)):
            await one(_words(rng.randrange(1, 9), i * 10 + t), rng.choice([0, 1, 2, 4]), sid,
                      cut=rng.choice([None, None, None, 1, 2]))
            await asyncio.sleep(rng.random() * 0.02)
        if rng.random() < 0.7:
            await engine.close_session(sid)

    async def plain(i):
        base = _words(20, i % 3)
        await one(base[:rng.randrange(1, 20)] + _words(rng.randrange(0, 6), i), rng.choice([0, 1, 3, 6]),
                  cut=rng.choice([None, None, 1, 3]))

    async def go():
        await asyncio.gather(*[session(i) for i in range(4)], *[plain(i) for i in range(12)])
        await asyncio.sleep(0.1)  # aborts of cut-off requests reach the scheduler
        _idle(engine)
        for sid in list(engine.scheduler.sessions.table.sessions):
            await engine.close_session(sid)
        await engine.flush_cache()
        return _idle(engine)

    acct = run_started(engine, go)
    assert not errors and len(done) >= 10
    assert acct["free"] == acct["capacity"] and acct["kv_pages_free"] == acct["kv_pages"], acct



@pytest.mark.parametrize("overlap", [True, False])
def test_session_turns_with_nothing_to_generate_keep_the_live_state(nemotron, overlap):
    """A streaming turn with max_new_tokens 0 whose state ends up covering all of its prompt but the last
    token, other than through a one-token turn: (a) its prefill chunk ends there (history 15 + 14 new
    tokens, chunks of 8 cut to pages of 4: 20, then 28 of 29); (b) the session's first turn hits the
    cache there (the same prompt sent before). It folds that token into the live state like the one-token
    turn: the next turn continues from the whole history, with the cold engine's outputs."""
    engine = _engine(nemotron, disable_overlap_schedule=not overlap)
    chunk_end = [(_words(9, 1), 6), (_words(14, 2), 0), (_words(3, 3), 2)]
    cached_first = [(_words(13, 5), 0), (_words(2, 6), 2)]

    async def go():
        out = []
        sid = await engine.open_session(None, True, None, None)
        for new, n in chunk_end:
            out.append(await _one(engine, new, n, session_id=sid))
            _idle(engine)
        await engine.close_session(sid)
        await _one(engine, cached_first[0][0], 3)  # leaves its snapshot at 12 of 13 tokens
        sid = await engine.open_session(None, True, None, None)
        for new, n in cached_first:
            out.append(await _one(engine, new, n, session_id=sid))
            _idle(engine)
        await engine.close_session(sid)
        return out

    out = run_started(engine, go)
    assert [o[2] for o in out] == [0, 15, 29, 12, 13]  # the turns after the max_new_tokens 0 ones: live
    assert [len(o[0]) for o in out] == [6, 0, 2, 0, 2]
    cold = _engine(nemotron, disable_radix_cache=True)
    ref = run_started(cold, lambda: _cold_history(cold, chunk_end))
    ref += run_started(cold, lambda: _cold_history(cold, cached_first))
    assert [o[0] for o in out] == ref

async def _enumerate(gen):
    k = 0
    async for o in gen:
        yield k, o
        k += 1
