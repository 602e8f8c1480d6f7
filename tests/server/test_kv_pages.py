"""KV page accounting (pure) and the hybrid memory plan (arithmetic)."""

import random

import pytest

from mambaserve.server.cache.pages import PageAllocator, pages_for
from mambaserve.server.engine.memory import GiB, plan_hybrid


def test_pages_grow_release_and_stay_accounted_under_random_use():
    rng = random.Random(0)
    alloc = PageAllocator(37, 4)
    held: dict[int, int] = {}  # owner -> tokens it asked for
    for _ in range(2000):
        owner = rng.randrange(8)
        if rng.random() < 0.3:
            freed = alloc.release(owner)
            assert freed == pages_for(held.pop(owner, 0), 4)
        else:
            tokens = held.get(owner, 0) + rng.randrange(0, 13)
            before = list(alloc.pages(owner))
            ok = alloc.ensure(owner, tokens)
            if ok:
                held[owner] = max(tokens, held.get(owner, 0))
                assert alloc.pages(owner)[:len(before)] == before  # growing never moves a page
                assert len(alloc.pages(owner)) == pages_for(held[owner], 4)
            else:  # refused: nothing allocated
                assert alloc.pages(owner) == before and pages_for(tokens, 4) - len(before) > alloc.num_free
        alloc.check()
        assert alloc.num_used == sum(pages_for(t, 4) for t in held.values())


def test_hybrid_plan_one_slot_per_running_request_and_pages_for_the_rest():
    per_slot, per_page = 2 * 2**20, 64 * 2**10
    plan = plan_hybrid(total=80 * GiB, in_use=20 * GiB, fraction=0.9, per_slot=per_slot, per_page=per_page,
                       reserve=GiB, page_size=16, context_length=8192, slots=None, running=None, default_running=256)
    assert plan.slots == plan.max_running == 256
    assert plan.pages == 256 * 512  # capped at every running request's full context: the budget has more
    small = plan_hybrid(total=8 * GiB, in_use=6 * GiB, fraction=0.9, per_slot=per_slot, per_page=per_page,
                        reserve=GiB // 2, page_size=16, context_length=8192, slots=None, running=None,
                        default_running=256)
    budget = int(0.9 * 8 * GiB) - 6 * GiB - GiB // 2
    assert small.slots * per_slot + small.pages * per_page <= budget and small.pages >= 512
    with pytest.raises(ValueError, match=r"one request of --context-length 131072 .* lower --context-length"):
        plan_hybrid(total=8 * GiB, in_use=7 * GiB, fraction=0.9, per_slot=per_slot, per_page=per_page, reserve=0,
                    page_size=16, context_length=131072, slots=None, running=None, default_running=256)
    with pytest.raises(ValueError, match="--mamba-cache-size 5000"):
        plan_hybrid(total=8 * GiB, in_use=6 * GiB, fraction=0.9, per_slot=per_slot, per_page=per_page, reserve=0,
                    page_size=16, context_length=8192, slots=5000, running=None, default_running=256)


def test_hybrid_plan_explicit_kv_tokens():
    kw = dict(total=8 * GiB, in_use=6 * GiB, fraction=0.9, per_slot=2 * 2**20, per_page=64 * 2**10, reserve=0,
              page_size=16, context_length=8192, slots=None, running=None, default_running=256)
    plan = plan_hybrid(**kw, pages=1024)
    assert plan.pages == 1024 and plan.slots * kw["per_slot"] + 1024 * kw["per_page"] <= plan.budget
    with pytest.raises(ValueError, match="less than one request"):
        plan_hybrid(**kw, pages=100)
    with pytest.raises(ValueError, match="needs .* GiB of KV pages"):
        plan_hybrid(**kw, pages=10**6)


def test_hybrid_plan_with_the_radix_cache_keeps_room_for_snapshots_and_prefixes():
    kw = dict(total=80 * GiB, in_use=20 * GiB, fraction=0.9, per_slot=2 * 2**20, per_page=64 * 2**10, reserve=GiB,
              page_size=16, context_length=8192, slots=None, running=None, default_running=256)
    plain, cached = plan_hybrid(**kw), plan_hybrid(**kw, cached=True)
    assert cached.max_running == plain.max_running == 256
    assert cached.slots == 2 * plain.slots  # a snapshot slot per running request
    assert cached.pages == 2 * plain.pages  # cached prefixes beside what the running requests may fill
    assert cached.slots * kw["per_slot"] + cached.pages * kw["per_page"] <= cached.budget
    # an explicit small pool: three quarters run, the rest holds snapshots (as for pure Mamba2); an explicit
    # running limit is kept
    few = plan_hybrid(**{**kw, "slots": 8}, cached=True)
    assert (few.slots, few.max_running) == (8, 6)
    assert plan_hybrid(**{**kw, "slots": 8, "running": 8}, cached=True).max_running == 8
    assert plan_hybrid(**{**kw, "slots": 8}).max_running == 8  # no cache: nothing else needs a slot


def test_holds_share_the_trees_pages_and_give_back_exactly_their_own():
    """A request's pages through the cache: admitted on a miss, its prompt's page-aligned prefix kept with a
    snapshot, a second request hits it (reading the tree's pages, its own from the next page), both end:
    every page is free or the tree's, and the tree's go when evicted."""
    from mambaserve.server.cache.prefix_cache import PrefixCache
    from mambaserve.server.cache.slots import SlotAllocator

    pages = PageAllocator(12, 4)
    cache = PrefixCache(SlotAllocator(4), 4, pages=pages)
    prompt = list(range(1, 11))  # 10 tokens: 2 whole pages and a partial one
    a = cache.admit_kv(None, 0, 14)
    assert len(cache.block_table(a)) == 4 and pages.num_free == 8
    slot = cache.allocator.alloc()
    assert cache.keep_kv(a, prompt[:8], slot)  # the state after 8 tokens, with its 2 pages
    assert a.prefix == cache.block_table(a)[:2] and len(pages.pages(a)) == 2
    cached, node, _ = cache.match(prompt[:9])
    assert cached == 8
    b = cache.admit_kv(node, cached, 14)
    cache.unlock(node)  # (the snapshot's copy has run)
    assert b.prefix == a.prefix and len(pages.pages(b)) == 2  # tokens 8..13 in its own pages
    cache.release_kv(a)
    cache.release_kv(b)
    pages.check(cache.tree_pages())
    assert pages.num_free == 10 and cache.evictable_pages() == 2
    assert cache.admit_kv(None, 0, 48) is not None  # the whole pool: the cached prefix is evicted for it
    assert cache.tree_pages() == [] and cache.allocator.num_free == 4
