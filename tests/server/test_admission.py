"""Admission keeps snapshots: hits take over their own leaf snapshot when no slot is free, queued hits'
snapshots outlive older ones, and short hit prefills go before long cold ones (for a bounded time)."""

import asyncio

from mambaserve.server.engine.policy import admission_order
from mambaserve.server.engine.request import SamplingParams
from tests.server.conftest import accounting, assert_idle, make_engine, run, run_started, serving

GREEDY = {"temperature": 0, "ignore_eos": True}


def _prompt(n, seed):
    return [(seed * 31 + 7 * k * k + k) % 94 + 1 for k in range(n)]


def test_admission_order_short_prefills_first_until_aged():
    waiting = [("cold", 500, 0, 0), ("hit", 12, 0, 0), ("aged", 900, 4, 0), ("hit2", 12, 1, 0), ("mid", 40, 3, 0)]
    assert admission_order(waiting, max_overtaken=4) == ["aged", "hit", "hit2", "mid", "cold"]
    assert admission_order(waiting, max_overtaken=1) == ["aged", "hit2", "mid", "hit", "cold"]
    assert admission_order([], 4) == []


def test_admission_order_groups_holding_fewer_running_places_first():
    """The waiting choices of a request whose group runs three already go after a newer request of its own
    (even a longer one), until they have been overtaken enough."""
    waiting = [("choice-5", 1, 0, 3), ("choice-6", 1, 0, 3), ("newer", 200, 0, 0), ("choice-4", 1, 4, 3)]
    assert admission_order(waiting, max_overtaken=4) == ["choice-4", "newer", "choice-5", "choice-6"]


def test_conversations_keep_their_snapshots_in_a_pool_barely_larger_than_them(tiny_ckpt):
    """Six conversations, eight slots, six running at once, rounds sent together (a barrier): each turn
    continues from its conversation's last state. Copying each hit into a fresh slot needs twelve
    slots, so copies evicted the snapshots of the turns queued behind them (0.29, 0.45, 0.45 here; ~0.1
    at this ratio on a GPU); taking the own leaf over keeps them. A turn that arrives after the others'
    prefills may still lose its state to their prompt snapshots (LRU cannot know it comes), so the
    rounds are judged together."""
    engine = make_engine(tiny_ckpt, mamba_cache_size=8, max_running_requests=6, context_length=512)
    convs = [_prompt(40, s) for s in range(6)]

    async def turn(c, i):
        r = await c.post("/generate", json={"input_ids": convs[i],
                                            "sampling_params": {"max_new_tokens": 4, **GREEDY}})
        assert r.status_code == 200, r.text
        body = r.json()
        convs[i] = convs[i] + body["output_ids"] + _prompt(6, 10 * i + len(convs[i]))
        return body["meta_info"]["cached_tokens"], body["meta_info"]["prompt_tokens"]

    async def go():
        async with serving(engine) as c:
            rounds = [await asyncio.gather(*(turn(c, i) for i in range(6))) for _ in range(4)]
            return rounds, await accounting(engine)

    rounds, acc = run(go())
    later = [x for r in rounds[1:] for x in r]
    assert sum(h for h, _ in later) / sum(p for _, p in later) >= 0.6, rounds
    assert_idle(acc)


def test_capacity_misses_count_evicted_prefixes_not_new_ones(tiny_ckpt):
    """A prompt whose snapshot was evicted for space is a capacity miss (more slots would have hit it);
    prompts never seen are compulsory misses and count nothing there."""
    engine = make_engine(tiny_ckpt, mamba_cache_size=3, max_running_requests=1)
    first = _prompt(30, 1)

    async def gen(c, ids):
        r = await c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2, **GREEDY}})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    def capacity_misses(text):
        line = next(x for x in text.splitlines() if x.startswith("mambaserve_prefix_cache_capacity_miss_tokens_total"))
        return float(line.split()[-1])

    async def go():
        async with serving(engine) as c:
            await gen(c, first)
            fresh = [await gen(c, _prompt(30, s)) for s in range(2, 8)]  # new prompts: evict the first's states
            misses_before = capacity_misses((await c.get("/metrics")).text)
            again = await gen(c, first)
            return fresh, misses_before, again, capacity_misses((await c.get("/metrics")).text)

    fresh, before, again, after = run(go())
    assert fresh == [0] * 6 and before == 0  # compulsory: never cached
    assert again < 29 and after == 29 - again  # the first prompt's snapshot (29 tokens) was evicted for space


def test_resends_keep_hitting_in_a_pool_full_of_used_snapshots(tiny_ckpt):
    """Prompts each sent twice (the second hits the first's prompt snapshot, which is kept from then on)
    fill a small pool with snapshots in use; a new prompt's snapshot must still find room, else its
    resend misses."""
    engine = make_engine(tiny_ckpt, mamba_cache_size=6, max_running_requests=1)

    async def go():
        async with serving(engine) as c:
            cached = []
            for s in range(8):
                for _ in range(2):
                    r = await c.post("/generate", json={"input_ids": _prompt(20, s),
                                                        "sampling_params": {"max_new_tokens": 1, **GREEDY}})
                    cached.append(r.json()["meta_info"]["cached_tokens"])
            return cached, await accounting(engine)

    cached, acc = run(go())
    assert cached[1::2] == [19] * 8, cached  # every resend hits all but the last token
    assert_idle(acc)


def test_a_large_n_request_takes_turns_with_a_newer_one(tiny_ckpt):
    """n = 12 choices on 4 running places, then a newer request: it gets a place when the first choice ends,
    not after the twelve (before: 8 choices ran to their end while it waited)."""
    engine = make_engine(tiny_ckpt, mamba_cache_size=8, max_running_requests=4)
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)

    async def go():
        done = []

        async def choice(g):
            async for out in g:
                pass
            done.append(out)
        big = [asyncio.ensure_future(choice(g)) for g in engine.generate_n(_prompt(8, 1), params, 12)]
        for _ in range(2000):  # (bounded: a miss fails with what the scheduler held, not a hung suite)
            if (acc := await engine.accounting())["running"] >= 4:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError(f"the n = 12 request never held the 4 running places: {acc}, {len(done)} ended")
        ended_before_first_token = None
        async for out in engine.generate(_prompt(8, 2), params):
            if ended_before_first_token is None:
                ended_before_first_token = len(done)
        await asyncio.gather(*big)
        return ended_before_first_token, done, await accounting(engine)

    ended, done, acc = run_started(engine, go)
    assert ended <= 4, ended
    assert len(done) == 12 and all(o.completion_tokens == 24 for o in done)
    assert_idle(acc)


def test_a_short_remainder_runs_right_after_an_extend_a_long_one_waits_for_the_decoders(tiny_ckpt, monkeypatch):
    """With another request decoding, a prompt's first chunk (16 tokens here) is followed at once by its last 4
    (a quarter of the chunk: policy.next_mode_is_decode), while a remainder of 8 waits for a decode step first."""
    engine = make_engine(tiny_ckpt, disable_radix_cache=True)
    steps = []
    forward = engine.scheduler.runner.forward
    monkeypatch.setattr(engine.scheduler.runner, "forward",
                        lambda b: steps.append((b.mode.name, b.num_tokens)) or forward(b))

    async def go(c, length):
        del steps[:]
        body = {"input_ids": _prompt(5, 1), "sampling_params": {"max_new_tokens": 200, **GREEDY}}
        decoder = asyncio.create_task(c.post("/generate", json=body))
        while ("DECODE", 1) not in steps:  # it decodes: send the prompt beside it
            await asyncio.sleep(0.002)
        mark = len(steps)
        other = {"input_ids": _prompt(length, 2), "sampling_params": {"max_new_tokens": 2, **GREEDY}}
        assert (await c.post("/generate", json=other)).status_code == 200
        assert (await decoder).status_code == 200
        return steps[mark:]

    async def both():
        async with serving(engine) as c:
            return await go(c, 20), await go(c, 24)

    short, long = run(both())
    first = short.index(("EXTEND", 16))
    assert short[first + 1] == ("EXTEND", 4) and short[first + 2][0] == "DECODE", short
    first = long.index(("EXTEND", 16))
    assert long[first + 1][0] == "DECODE" and long[first + 2] == ("EXTEND", 8), long
