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
