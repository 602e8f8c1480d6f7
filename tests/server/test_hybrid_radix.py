"""The radix cache of hybrid models (KV pages + Mamba snapshots in one tree) through the engine: hits give
exactly the cold engine's greedy outputs and logprobs at page sizes 1, 4 and 16, chat turns hit past the
previous answer and resent prompts at their last page boundary, and with pages and slots both scarce every
request finishes and every page and slot is accounted for (the invariant check runs after every step)."""

import asyncio
import random

import pytest

from tests.server.conftest import checked_accounting, greedy, make_engine, run_started
from tests.server.tiny_hybrids import make_hybrid_checkpoint


def _engine(path, **kw):
    return make_engine(path, **{**dict(context_length=256, chunked_prefill_size=16, max_running_requests=4, mamba_cache_size=16), **kw})


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return make_hybrid_checkpoint(tmp_path_factory.mktemp("granite"), "granite_dense_rope")


def _words(n, seed):
    return [(seed * 31 + 7 * k * k + k) % 94 + 1 for k in range(n)]


def _chat(engine):
    """A prompt sent twice, then three chat turns (history + answer + new words), then a prompt and two
    branches of it (sharing 40 tokens), run concurrently."""
    async def go():
        p1 = _words(37, 1)
        first = await greedy(engine, p1, 6)
        again = await greedy(engine, p1, 6)
        history, turns = p1 + first[0], []
        for i in range(3):
            history += _words(5 + 4 * i, 10 + i)
            t = await greedy(engine, history, 5)
            turns.append(t)
            history += t[0]
        shared = _words(40, 3)
        lead = await greedy(engine, shared + _words(9, 4), 4)
        branches = await asyncio.gather(greedy(engine, shared + _words(3, 5), 4), greedy(engine, shared + _words(7, 6), 4))
        return [first, again, *turns, lead, *branches], checked_accounting(engine)
    return go


@pytest.mark.parametrize("family,page_size", [("granite_dense_rope", 1), ("nemotron_h", 4), ("bamba", 16)])
def test_hits_give_the_cold_outputs_and_logprobs(tmp_path, granite, family, page_size):
    path = granite if family == "granite_dense_rope" else make_hybrid_checkpoint(tmp_path / family, family)
    warm = _engine(path, page_size=page_size)
    cold = _engine(path, page_size=page_size, disable_radix_cache=True)
    got, acct = run_started(warm, _chat(warm))
    ref, _ = run_started(cold, _chat(cold))
    for (ids, lps, _), (rids, rlps, rcached) in zip(got, ref):
        assert ids == rids
        assert lps == pytest.approx(rlps, abs=1e-4)
        assert rcached == 0
    cached = [c for _, _, c in got]
    aligned = lambda n: n - n % page_size  # noqa: E731
    assert cached[0] == 0
    # the resent prompt hits at its last page boundary before its last token
    assert cached[1] == aligned(37 - 1)
    # every turn reuses the previous request's prompt + answer up to its last page boundary (overlap
    # scheduling ran the last answer token: the final state, where it is on a page, else the rolling snapshot)
    prompts = [37, 37 + 6 + 5]
    prompts += [prompts[-1] + 5 + 9, prompts[-1] + 5 + 9 + 5 + 13]
    for i in range(3):
        assert cached[2 + i] == aligned(prompts[i] + (6 if i == 0 else 5)), (i, cached)
    # the branches share 40 tokens with the lead: its chunk end at 32. A branch admitted a step after the
    # other may also hit the other's prompt snapshot at 40 (page-aligned at page size 4), so up to 40.
    assert all(32 <= c <= 40 for c in cached[6:8]), cached
    assert min(cached[6:8]) == 32
    assert acct["running"] == 0 and acct["free"] + acct["held_by_tree"] == acct["capacity"]
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"] and acct["kv_pages_tree"] > 0
    assert acct["kv_pages_evictable"] == acct["kv_pages_tree"]  # nothing runs: every cached page may go


def test_scarce_pages_and_slots_evict_and_never_leak(tmp_path, granite):
    """Thirty requests (many sharing prefixes, some resent) on 4 state slots and a KV pool of two contexts,
    prefill chunks of 5 tokens, page size 4: both kinds of eviction happen, every request gives the cold
    engine's outputs, and afterwards every page and slot is free or the tree's."""
    rng = random.Random(3)
    bases = [_words(rng.randrange(8, 30), s) for s in range(4)]
    prompts = [rng.choice(bases)[:rng.randrange(5, 30)] + _words(rng.randrange(1, 12), 50 + i) for i in range(24)]
    prompts += prompts[:6]
    jobs = [(p, rng.randrange(1, 9)) for p in prompts]
    kw = dict(page_size=4, context_length=48, max_total_tokens=96, chunked_prefill_size=5, mamba_cache_size=4,
              max_running_requests=3)

    def go(engine):
        async def run():
            outs = await asyncio.gather(*[greedy(engine, p, n) for p, n in jobs])
            return outs, checked_accounting(engine)
        return run

    warm = _engine(granite, **kw)
    got, acct = run_started(warm, go(warm))
    cold = _engine(granite, **{**kw, "disable_radix_cache": True})
    ref, _ = run_started(cold, go(cold))
    assert [o[0] for o in got] == [o[0] for o in ref]
    for (_, lps, _), (_, rlps, _) in zip(got, ref):
        assert lps == pytest.approx(rlps, abs=1e-4)
    assert sum(c for _, _, c in got) > 0  # hits happened under the pressure
    evicted = warm.metrics.registry.get_sample_value("mambaserve_cache_evictions_total", {"tier": "gpu"})
    assert 0 < warm.scheduler.cache.page_evictions < evicted  # leaves for their pages, and snapshots for slots
    assert acct["running"] == acct["waiting"] == 0
    assert acct["free"] + acct["held_by_tree"] == acct["capacity"]
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"] == 24


def test_tracked_snapshots_come_with_their_pages(granite):
    """extra_buffer on a hybrid: the scan's states every 8 tokens inside a chunk go to the tree with the KV
    pages of their tokens, so a branch that leaves a prompt inside its only chunk hits the last tracked
    position before it, with the cold engine's outputs; an interval that is not a page multiple is refused."""
    kw = dict(page_size=4, chunked_prefill_size=64, mamba_cache_strategy="extra_buffer", mamba_track_interval=8)
    shared = _words(27, 7)
    prompts = [shared + _words(9, 8), shared + _words(5, 9)]

    def go(engine):
        async def run():
            return [await greedy(engine, p, 4) for p in prompts], checked_accounting(engine)
        return run

    warm = _engine(granite, **kw)
    got, acct = run_started(warm, go(warm))
    cold = _engine(granite, page_size=4, disable_radix_cache=True)
    ref, _ = run_started(cold, go(cold))
    assert [o[0] for o in got] == [o[0] for o in ref]
    assert got[1][1] == pytest.approx(ref[1][1], abs=1e-4)
    assert got[1][2] == 24  # the tracked state at 24 (the prompt's own snapshots lie past the shared 27)
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"]
    with pytest.raises(ValueError, match="--mamba-track-interval 8 must be a multiple of --page-size 16"):
        _engine(granite, page_size=16, mamba_cache_strategy="extra_buffer", mamba_track_interval=8)
    with pytest.raises(ValueError, match=r"--mamba-track-interval \d+ \(the default\) must be a multiple of --page-size 3"):
        _engine(granite, page_size=3, mamba_cache_strategy="extra_buffer")


@pytest.mark.parametrize("slots,running,chunk,answer", [(2, 1, 64, (7,)), (4, 3, 64, (7,)), (4, 3, 12, (7,)), (2, 1, 64, (12, 7))])
def test_a_chat_in_a_small_pool_hits_its_latest_turn(granite, slots, running, chunk, answer):
    """A chat of nine turns (history + answer + 20 new tokens) on a state pool of 2 or 4 slots, page size
    16: the pool fills with this conversation's own earlier snapshots, each refreshed by its last match.
    A turn's snapshot at its prompt's last page boundary (a chunk-end donation) takes over the slot of the
    deepest snapshot on its path below which nothing branches: the one it started from, or (after an
    answer of 12, which ends on a page and leaves its final state: the next turn finds the pool full and
    takes that snapshot's slot over at admission) the one before. Every turn hits its previous turn's prompt (it stayed at the second turn's), with the cold
    engine's outputs."""
    kw = dict(page_size=16, chunked_prefill_size=chunk, mamba_cache_size=slots, max_running_requests=running,
              context_length=512)

    def go(engine):
        async def run():
            history, out = [], []
            for t in range(9):
                history += _words(20, 60 + t)
                ids, lps, cached = await greedy(engine, history, answer[t % len(answer)])
                out.append((len(history), ids, lps, cached))
                history += ids
            return out, checked_accounting(engine)
        return run

    warm = _engine(granite, **kw)
    got, acct = run_started(warm, go(warm))
    cold = _engine(granite, **{**kw, "disable_radix_cache": True})
    ref, _ = run_started(cold, go(cold))
    assert [g[1] for g in got] == [r[1] for r in ref]
    for g, r in zip(got, ref):
        assert g[2] == pytest.approx(r[2], abs=1e-4)
    prompt_lens = [g[0] for g in got]
    # turn t hits at least the previous prompt's last page boundary (its last token's state is never cached;
    # an answer that ends on a page leaves a deeper one)
    hits = [g[3] for g in got[1:]]
    assert all(h >= (n - 1) // 16 * 16 for h, n in zip(hits, prompt_lens)), (hits, prompt_lens)
    assert acct["free"] + acct["held_by_tree"] == acct["capacity"]
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"]


@pytest.mark.parametrize("page_size,steps", [(4, 1), (16, 2)])
def test_a_hit_prefills_in_one_step_where_the_scan_takes_the_page_snapshot(granite, page_size, steps):
    """A chat turn's prefill past its hit runs in one step when the page size divides the scan's chunk (8 here):
    the pass snapshots the state at the prompt's last page boundary itself, and the next turn hits there. A page
    of 16 does not divide it: the chunk is cut at that boundary (two steps), with the same hits."""
    engine = _engine(granite, page_size=page_size, chunked_prefill_size=256)
    assert engine.scheduler.runner.scan_chunk == 8
    extends = []
    forward = engine.scheduler.runner.forward

    def counting(batch):
        extends.append(batch.mode.name == "EXTEND")
        return forward(batch)

    engine.scheduler.runner.forward = counting

    async def go():
        history = _words(45, 2)
        first = await greedy(engine, history, 4)
        # 75 tokens, hit at 48: the last page boundary before the last token is 72 (in the scan's last chunk, from
        # 72) or 64 (before it: cut there)
        history += first[0] + _words(26, 3)
        del extends[:]
        second = await greedy(engine, history, 4)
        turn_steps = sum(extends)
        history += second[0] + _words(5, 4)
        third = await greedy(engine, history, 3)
        return second, turn_steps, third, checked_accounting(engine)

    second, turn_steps, third, _ = run_started(engine, go)
    last = 75 - 1
    assert second[2] == 48 and turn_steps == steps
    assert third[2] >= last - last % page_size  # the second turn's prompt snapshot (or the rolling one past it)
