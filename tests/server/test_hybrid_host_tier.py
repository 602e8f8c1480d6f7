"""The host tier of hybrid models: an evicted Mamba snapshot goes to host memory while its KV pages stay in
the device tree; a host hit loads the snapshot and reads the tree's pages; KV eviction of a node drops the
host snapshot there (a state without the KV before it serves nothing), and the host tier dropping an entry
for room lets the device tree free the pages it kept for it. Through the engine: hits from the host give
the cold engine's greedy outputs and logprobs, and every slot, host slot and page is accounted for."""

import asyncio
import random

import pytest

from mambaserve.server.cache.host_tier import HostLock, HostTier
from mambaserve.server.cache.pages import PageAllocator
from mambaserve.server.cache.prefix_cache import PrefixCache
from mambaserve.server.cache.slots import SlotAllocator
from tests.server.conftest import checked_accounting, greedy, make_engine, run_started
from tests.server.test_hybrid_radix import _words
from tests.server.test_hybrid_sessions import _gen


def _cache(slots=1, host=2, pages=8, page_size=2):
    return PrefixCache(SlotAllocator(slots), page_size, host=HostTier(host, page_size),
                       pages=PageAllocator(pages, page_size))


def _finish(cache, tokens, slot, lock=None, cached=0):
    """A request over ``tokens`` (its first ``cached`` matched under ``lock``) ends: its KV and the state in
    ``slot`` after them go to the tree (the tree frees the slot's old snapshot if it had one there)."""
    hold = cache.admit_kv(lock, cached, len(tokens))
    assert hold is not None
    if lock is not None:
        cache.unlock(lock)
    if not cache.keep_kv(hold, tokens, slot):
        cache.free(slot)
    cache.release_kv(hold)


def _pages_held(cache):
    return len(cache.tree_pages())


def test_an_evicted_snapshot_goes_to_the_host_and_its_kv_stays_for_it():
    cache = _cache()
    a = cache.alloc()
    _finish(cache, [1, 2, 3, 4], a)
    assert _pages_held(cache) == 2
    b = cache.alloc()  # the only slot: [1, 2, 3, 4]'s snapshot is offloaded, its leaf keeps its pages
    assert b == a and cache.take_pending().ops == [("offload", a, 0)]
    assert _pages_held(cache) == 2 and cache.tree.host_marks() == [(1, 2, 3, 4)]
    cache.check_invariants()

    cached, lock, tier = cache.match([1, 2, 3, 4, 5])
    assert (cached, tier) == (4, "host") and isinstance(lock, HostLock)
    hold = cache.admit_kv(lock, cached, 7)  # the tree's two pages, then the request's own
    assert hold.prefix == list(cache.tree.pages_to(lock.kv)) and len(hold.prefix) == 2
    cache.restore(lock, b)
    assert cache.take_pending().ops == [("load", 0, b)]
    assert cache.tree.evictable_pages() == 0  # pinned by the match's lock and by the request
    cache.unlock(lock)
    cache.release_kv(hold)
    assert cache.tree.evictable_pages() == 2
    cache.free(b)
    cache.check_invariants()


def test_kv_eviction_drops_the_host_snapshot_it_makes_useless():
    cache = _cache(pages=4)
    a = cache.alloc()
    _finish(cache, [1, 2, 3, 4], a)
    cache.free(cache.alloc())  # offloaded; the slot comes back free
    assert cache.host.allocator.num_used == 1 and _pages_held(cache) == 2
    # a request needing the whole pool: the marked leaf goes for its pages, its host entry with it
    hold = cache.admit_kv(None, 0, 8)
    assert hold is not None and _pages_held(cache) == 0
    assert cache.host.allocator.num_used == 0 and cache.tree.host_marks() == []
    assert cache.host.evictions == 1
    cache.check_invariants()
    assert cache.match([1, 2, 3, 4, 5]) == (0, None, None)  # never a snapshot whose KV is gone
    cache.release_kv(hold)
    cache.pages.check(cache.tree_pages())


def test_the_invariant_check_finds_tiers_out_of_step():
    cache = _cache()
    a = cache.alloc()
    _finish(cache, [1, 2, 3, 4], a)
    cache.free(cache.alloc())
    entry = cache.host.tree.match_prefix([1, 2, 3, 4]).node
    cache.host.allocator.free(cache.host.tree.take(entry))  # gone from the host behind the tree's back
    with pytest.raises(AssertionError, match="marked nodes without a host entry: 1"):
        cache.check_invariants()


def test_a_host_hit_pins_its_kv_against_eviction_until_unlocked():
    cache = _cache(pages=4)
    a = cache.alloc()
    _finish(cache, [1, 2, 3, 4], a)
    cache.free(cache.alloc())
    cached, lock, tier = cache.match([1, 2, 3, 4, 5])
    assert tier == "host"
    assert cache.admit_kv(None, 0, 8) is None  # the locked leaf's pages cannot go: too few evictable
    cache.unlock(lock)
    assert cache.host.allocator.num_used == 1  # nothing was dropped while it was in use
    cache.check_invariants()


def test_the_host_making_room_frees_the_kv_it_kept_and_unmarks_inner_nodes():
    cache = _cache(slots=1, host=1, pages=8)
    a = cache.alloc()
    _finish(cache, [1, 2, 3, 4], a)
    b = cache.alloc()  # [1, 2, 3, 4] to the host
    _finish(cache, [5, 6], b)
    c = cache.alloc()  # [5, 6] to the host, which drops [1, 2, 3, 4]: that leaf and its pages go
    cache.free(c)
    assert cache.tree.host_marks() == [(5, 6)] and _pages_held(cache) == 1
    assert cache.host.evictions == 1
    cache.check_invariants()
    # an inner node's host entry dropped for room: the node stays (its child needs the path), unmarked
    d = cache.alloc()
    _finish(cache, [7, 8], d)
    d = cache.alloc()  # [7, 8] to the host (dropping [5, 6])
    lock = cache.match([7, 8, 9, 10, 11])[1]
    _finish(cache, [7, 8, 9, 10], d, lock, 2)
    cache.free(cache.alloc())  # [7, 8, 9, 10] to the host: [7, 8] goes from the host, stays as a path
    assert cache.tree.host_marks() == [(7, 8, 9, 10)] and _pages_held(cache) == 2
    cache.check_invariants()


def test_the_deeper_snapshot_wins_and_a_refresh_keeps_the_mark():
    cache = _cache(slots=3, host=3)
    a = cache.alloc()
    _finish(cache, [1, 2, 3, 4], a)
    d = cache.alloc()
    _finish(cache, [1, 2, 7, 8], d)  # a second branch: [1, 2] is shared (not superseded by one deeper state)
    b = cache.alloc()
    _finish(cache, [1, 2], b)  # a shallower snapshot on the same path
    cache.tree.match_prefix([1, 2, 9])  # ...used more recently
    c = cache.alloc()  # evicts [1, 2, 3, 4] (least recent) to the host
    cached, lock, tier = cache.match([1, 2, 3, 4, 5])
    assert (cached, tier) == (4, "host")  # deeper than the device's [1, 2]
    cache.restore(lock, c)
    cache.take_pending()
    _finish(cache, [1, 2, 3, 4], c, lock, 4)  # the same state back on the device, beside its host copy
    cached, lock, tier = cache.match([1, 2, 3, 4, 5])
    assert (cached, tier) == (4, "gpu")  # where both have it, the device wins
    cache.unlock(lock)
    freed = [cache.alloc() for _ in range(3)]  # every snapshot to the host ([1, 2, 3, 4]: the host has it)
    for slot in freed:
        cache.free(slot)
    assert sorted(cache.tree.host_marks()) == [(1, 2), (1, 2, 3, 4), (1, 2, 7, 8)]
    assert cache.host.allocator.num_used == 3
    cache.check_invariants()
    assert cache.flush() == 3 and cache.tree.host_marks() == [] and _pages_held(cache) == 0
    cache.check_invariants()


def test_flush_with_an_idle_session_empties_the_host_and_keeps_the_sessions_kv():
    cache = _cache(slots=2, host=2)
    a = cache.alloc()
    _finish(cache, [1, 2, 3, 4], a)
    b = cache.alloc()
    _finish(cache, [5, 6], b)
    session = cache.admit_kv(None, 0, 6)  # an idle streaming session reads [1, 2, 3, 4]'s path
    cache.keep_kv(session, [1, 2, 3, 4])
    x, y = cache.alloc(), cache.alloc()  # both snapshots to the host; the marked nodes keep their pages
    assert sorted(cache.tree.host_marks()) == [(1, 2, 3, 4), (5, 6)]
    assert cache.flush() == 2  # the host's two entries (the device tree holds none)
    assert cache.tree.host_marks() == [] and cache.host.allocator.num_used == 0
    assert cache.tree_pages() == session.prefix and len(session.prefix) == 2  # the session's path stays
    cache.check_invariants()
    cache.release_kv(session)
    cache.free(x)
    cache.free(y)
    assert cache.tree_pages() == []
    cache.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_both_tiers_in_step(seed):
    """Requests over a few shared prefixes on 2 slots, 3 host slots and 12 pages, with KV and slot pressure
    and matches held across other requests' admissions: after every operation the host tier holds exactly
    the marked nodes' keys, every page and slot is accounted for, and every host hit reads KV the tree holds."""
    rng = random.Random(seed)
    cache = _cache(slots=2, host=3, pages=12, page_size=2)
    bases = [[rng.randrange(1, 9) for _ in range(8)] for _ in range(3)]
    held = []  # (lock, hold) of requests between admission and their end
    host_hits = 0
    for _ in range(120):
        op = rng.random()
        if op < 0.6 and len(held) < 2:
            tokens = rng.choice(bases)[:rng.randrange(1, 9)] + [rng.randrange(1, 9) for _ in range(rng.randrange(0, 4))]
            cached, lock, tier = cache.match(tokens)
            hold = cache.admit_kv(lock, cached, len(tokens) + 2)
            if hold is None:
                cache.unlock(lock)
                continue
            if tier == "host":
                host_hits += 1
                assert hold.prefix == cache.tree.pages_to(lock.kv)[:cached // 2]
            held.append((tokens, lock, hold))
        elif held:
            tokens, lock, hold = held.pop(rng.randrange(len(held)))
            cache.unlock(lock)
            slot = cache.alloc()
            n = len(tokens) - len(tokens) % 2
            if slot is not None and n and not cache.keep_kv(hold, tokens[:n], slot):
                cache.free(slot)
            elif slot is not None and not n:
                cache.free(slot)
            cache.release_kv(hold)
        cache.check_invariants()
        cache.pages.check(cache.tree_pages())
        for _, _, hold in held:  # what a request reads of the tree is still the tree's
            assert set(hold.prefix) <= set(cache.tree_pages())
    assert host_hits > 0
    for _, lock, hold in held:
        cache.unlock(lock)
        cache.release_kv(hold)
    assert cache.tree.evictable_pages() == len(cache.tree_pages())
    cache.check_invariants()


def _engine(path, **kw):
    return make_engine(path, **{**dict(context_length=128, page_size=4, chunked_prefill_size=16, max_running_requests=2, mamba_cache_size=3), **kw})



def _host_hit_tokens(engine):
    return engine.metrics.registry.get_sample_value("mambaserve_prefix_cache_hit_tokens_total", {"tier": "host"})


def test_conversations_hit_from_the_host_with_the_cold_outputs(nemotron):
    """Six conversations, three turns each, on 3 device slots and a host tier: every later turn hits its
    whole history (prompt and answer end on a page), most of it from snapshots loaded from the host (the KV
    stayed in the device tree), and resent openings hit too, all with the cold engine's greedy outputs and
    logprobs; afterwards every slot, host slot and page is accounted for."""
    def go(engine):
        async def run():
            # prompts of 4k + 1 tokens: the state before the last token is on a page, and so is each turn's end
            convs = [_words(13 + 4 * s, s) for s in range(6)]
            outs, before = [], []
            for turn in range(3):
                for i in range(6):
                    out = await greedy(engine, convs[i], 3)
                    outs.append(out)
                    before.append(len(convs[i]) + 3)
                    convs[i] = convs[i] + out[0] + _words(5, 100 * turn + i)
            outs += await asyncio.gather(*[greedy(engine, c[:21], 2) for c in convs])  # resent openings
            return (outs, before), checked_accounting(engine)
        return run

    warm = _engine(nemotron, host_cache_size=10**7)
    (got, before), acct = run_started(warm, go(warm))
    cold = _engine(nemotron, disable_radix_cache=True)
    (ref, _), _ = run_started(cold, go(cold))
    assert [o[0] for o in got] == [o[0] for o in ref]
    for (_, lps, _), (_, rlps, _) in zip(got, ref):
        assert lps == pytest.approx(rlps, abs=1e-4)
    cached = [c for _, _, c in got]
    assert cached[6:18] == before[:12], cached
    assert sum(cached[18:]) > 0
    assert _host_hit_tokens(warm) >= sum(cached[6:18]) / 2  # most of them from the host (3 device slots)
    assert acct["held_by_host"] > 0 and acct["free"] + acct["held_by_tree"] == acct["capacity"]
    assert warm.metrics.registry.get_sample_value("mambaserve_host_cache_slots_used") == acct["held_by_host"]
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"]


def test_kv_pressure_drops_host_snapshots_and_never_loads_one_without_its_kv(nemotron):
    """A KV pool of 20 pages under conversations that need more: KV eviction removes marked leaves and
    their host snapshots go with them (host evictions), outputs stay the cold engine's, and the invariant
    check (after every step) finds both tiers in step."""
    rng = random.Random(5)
    bases = [_words(rng.randrange(10, 25), s) for s in range(5)]
    jobs = [(rng.choice(bases)[:rng.randrange(6, 25)] + _words(rng.randrange(1, 8), 40 + i), rng.randrange(1, 6))
            for i in range(20)]
    jobs += jobs[:8]
    kw = dict(max_total_tokens=80, context_length=40, mamba_cache_size=3, host_cache_size=10**7)

    def go(engine):
        async def run():
            outs = [await greedy(engine, p, n) for p, n in jobs[:10]]
            outs += await asyncio.gather(*[greedy(engine, p, n) for p, n in jobs[10:]])
            return outs, checked_accounting(engine)
        return run

    warm = _engine(nemotron, **kw)
    got, acct = run_started(warm, go(warm))
    cold = _engine(nemotron, **{**kw, "disable_radix_cache": True, "host_cache_size": 0})
    ref, _ = run_started(cold, go(cold))
    assert [o[0] for o in got] == [o[0] for o in ref]
    for (_, lps, _), (_, rlps, _) in zip(got, ref):
        assert lps == pytest.approx(rlps, abs=1e-4)
    assert warm.scheduler.cache.page_evictions > 0
    host_evicted = warm.metrics.registry.get_sample_value("mambaserve_cache_evictions_total", {"tier": "host"})
    assert host_evicted > 0  # (the host tier holds 100s of these tiny states: only KV eviction dropped them)
    assert _host_hit_tokens(warm) > 0
    assert acct["running"] == acct["waiting"] == 0 and acct["free"] + acct["held_by_tree"] == acct["capacity"]
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"] == 20


def test_streaming_sessions_spilled_under_slot_pressure_come_back_from_the_host(nemotron):
    """Four streaming sessions taking turns on 4 device slots: a session's live state (its turns end on a
    page) goes to the tree when others need slots, down to the host tier, and its next turn resumes from
    there on the KV the tree kept; every answer equals its history resent to an engine without a cache."""
    engine = _engine(nemotron, mamba_cache_size=4, host_cache_size=10**7, chunked_prefill_size=8)
    firsts = [_words(9, 20 + s) for s in range(4)]

    async def go():
        sids = [await engine.open_session(None, True, None, None) for _ in range(4)]
        outs = []
        for turn in range(3):
            for i, sid in enumerate(sids):
                outs.append((i, turn, await _gen(engine, firsts[i] if turn == 0 else _words(5, 40 + 4 * turn + i), 3,
                                                 sid)))
        for sid in sids:
            await engine.close_session(sid)
        return outs, checked_accounting(engine)

    outs, acct = run_started(engine, go)
    history = {i: [] for i in range(4)}
    resent = []
    for i, turn, (ids, _, _) in outs:
        history[i] += (firsts[i] if turn == 0 else _words(5, 40 + 4 * turn + i))
        resent.append((list(history[i]), 3))
        history[i] += ids
    cold = _engine(nemotron, disable_radix_cache=True)

    async def replay():
        return [await greedy(cold, p, n) for p, n in resent]
    ref = run_started(cold, replay)
    assert [o[2][0] for o in outs] == [r[0] for r in ref]
    for (_, _, (_, lps, _)), (_, rlps, _) in zip(outs, ref):
        assert lps == pytest.approx(rlps, abs=1e-4)
    cached = [o[2] for _, _, o in outs[4:]]
    assert cached == [12] * 4 + [20] * 4  # each turn resumed after its whole history (spilled, not live)
    assert _host_hit_tokens(engine) >= sum(cached) / 2
    assert acct["sessions"] == acct["held_by_sessions"] == 0
    assert acct["free"] + acct["held_by_tree"] == acct["capacity"]
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"]


def test_requests_closed_after_a_host_hit_give_back_their_locks_and_pages(nemotron):
    """Conversations pushed to the host, then their next turns closed by the client mid-generation, some
    while still waiting: every host entry, slot and page is accounted for (no lock left on a host entry
    or on the KV it needs), and the same turns resent answer as a cold engine does."""
    from mambaserve.server.engine.request import SamplingParams

    engine = _engine(nemotron, host_cache_size=10**7)
    cold = _engine(nemotron, disable_radix_cache=True)
    prompts = [_words(13 + 4 * s, 60 + s) for s in range(6)]

    async def go():
        firsts = [await greedy(engine, p, 3) for p in prompts]  # 6 conversations on 3 slots: most go to the host
        nexts = [p + f[0] + _words(5, 70 + i) for i, (p, f) in enumerate(zip(prompts, firsts))]
        params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
        streams = [engine.generate(n, params) for n in nexts]
        async for _ in streams[0]:
            break  # the first answers, then its client goes away; the others go before they finish
        for s in streams:
            await s.aclose()
        mid = checked_accounting(engine)
        return nexts, mid, [await greedy(engine, n, 4) for n in nexts], checked_accounting(engine)

    nexts, mid, got, acct = run_started(engine, go)

    async def replay():
        return [await greedy(cold, n, 4) for n in nexts]
    ref = run_started(cold, replay)
    assert [g[0] for g in got] == [r[0] for r in ref]
    assert all(c > 0 for _, _, c in got) and _host_hit_tokens(engine) > 0
    for a in (mid, acct):
        assert a["running"] == a["waiting"] == 0 and a["free"] + a["held_by_tree"] == a["capacity"]
        assert a["kv_pages_free"] + a["kv_pages_tree"] == a["kv_pages"] and a["kv_pages_evictable"] == a["kv_pages_tree"]
    assert engine.scheduler.cache.host.tree.root.lock_ref == 0
