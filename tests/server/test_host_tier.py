"""The host cache tier: snapshots evicted from the device are kept in host memory and loaded back on a
hit, bit for bit, with outputs identical to cold runs; the moves run in the order recorded."""

import asyncio

import torch

from mambaserve.server.cache.host_tier import HostTier
from mambaserve.server.cache.prefix_cache import PrefixCache, StateOps
from mambaserve.server.cache.slots import SlotAllocator
from tests.server.conftest import accounting, assert_idle, make_engine, run, serving

GREEDY = {"temperature": 0, "ignore_eos": True}


def _prompt(n, seed):
    return [(seed * 31 + 7 * k * k + k) % 94 + 1 for k in range(n)]


def test_eviction_offloads_then_a_hit_loads_back_in_recorded_order():
    cache = PrefixCache(SlotAllocator(2), host=HostTier(2))
    a, b = cache.alloc(), cache.alloc()
    assert cache.keep([1, 2, 3], a) and cache.keep([4, 5], b)
    slot = cache.alloc()  # evicts [1, 2, 3] (least recent): copied to the host first
    assert slot == a and cache.pending.ops == [("offload", a, 0)]
    cached, lock, tier = cache.match([1, 2, 3, 9])
    assert (cached, tier) == (3, "host")
    cache.restore(lock, slot)
    assert cache.take_pending().ops == [("offload", a, 0), ("load", 0, a)]
    cache.unlock(lock)
    cache.free(slot)
    assert cache.match([4, 5, 6])[2] == "gpu"  # the device copy wins where both have the prefix
    cache.check_invariants()


def test_host_tier_keeps_the_most_recent_and_never_a_locked_entry():
    host = HostTier(2)
    assert host.store([1]) == 0 and host.store([2]) == 1
    assert host.store([2]) is None  # already there
    _, lock = host.match([1, 7])
    assert host.store([3]) == 1  # [2] was least recent and unlocked; [1] is locked
    host.unlock(lock)
    assert host.match([2, 7]) == (0, None)
    host.check_invariants()


def test_ops_drop_writes_to_a_given_up_slot_but_keep_reads():
    ops = StateOps()
    ops.offload(3, 0)
    ops.copy(3, 5)
    ops.load(1, 3)
    ops.clear(3)
    ops.drop_writes_to(3)
    assert ops.ops == [("offload", 3, 0), ("copy", 3, 5)]
    assert [k for k, _ in ops.runs()] == ["offload", "copy"]


def test_round_trip_through_the_host_is_bit_exact(tiny_ckpt):
    engine = make_engine(tiny_ckpt, host_cache_size=10**7)
    runner = engine.scheduler.runner
    g = torch.Generator().manual_seed(0)
    state = {"conv": torch.randn(runner.pool.conv[:, 0].shape, generator=g).to(runner.pool.conv.dtype),
             "ssm": torch.randn(runner.pool.ssm[:, 0].shape, generator=g).to(runner.pool.ssm.dtype)}
    runner.write_slot(2, state)
    runner.apply_state_ops(StateOps([("offload", 2, 1), ("clear", 2, 2), ("load", 1, 5)]))
    back = runner.read_slot(5)
    assert torch.equal(back["conv"], state["conv"]) and torch.equal(back["ssm"], state["ssm"])
    assert not runner.read_slot(2)["ssm"].any()


def test_many_conversations_on_two_device_snapshots_keep_hitting_from_the_host(tiny_ckpt):
    """Twelve conversations, three turns each, one at a time, a device pool of three slots: every later
    turn hits (from the host tier), and every answer equals a cold engine's."""
    warm = make_engine(tiny_ckpt, mamba_cache_size=3, max_running_requests=1, host_cache_size=10**7)
    cold = make_engine(tiny_ckpt, disable_radix_cache=True)

    async def converse(engine):
        convs = [_prompt(20, s) for s in range(12)]
        outs, cached = [], []
        async with serving(engine) as c:
            for turn in range(3):
                for i in range(12):
                    r = await c.post("/generate", json={"input_ids": convs[i], "return_logprob": True,
                                                        "sampling_params": {"max_new_tokens": 3, **GREEDY}})
                    assert r.status_code == 200, r.text
                    body = r.json()
                    outs.append((body["output_ids"], [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]))
                    cached.append(body["meta_info"]["cached_tokens"])
                    convs[i] = convs[i] + body["output_ids"] + _prompt(5, 100 * turn + i)
            metrics = (await c.get("/metrics")).text
            return outs, cached, metrics, await accounting(engine)

    w_outs, w_cached, metrics, acc = run(converse(warm))
    c_outs, _, _, _ = run(converse(cold))
    assert [o for o, _ in w_outs] == [o for o, _ in c_outs]
    for (_, a), (_, b) in zip(w_outs, c_outs):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert all(n > 0 for n in w_cached[12:]), w_cached
    host_hits = next(float(x.split()[-1]) for x in metrics.splitlines()
                     if x.startswith('mambaserve_prefix_cache_hit_tokens_total{tier="host"}'))
    assert host_hits >= sum(w_cached[12:]) * 0.5
    assert_idle({k: v for k, v in acc.items()})
    assert acc["held_by_host"] > 0
