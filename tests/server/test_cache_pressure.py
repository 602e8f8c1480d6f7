"""Small pools: what persisted sessions and round-robin chats do to ordinary prefixes' hits, and whether the
misses that more cache would have turned into hits are counted (issue 31)."""

from __future__ import annotations

import random

from tests.server.conftest import make_engine, run, serving

GREEDY = {"temperature": 0, "ignore_eos": True}


def _counter(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def _workload(engine, chats: int, sessions: int, rounds: int, seed: int = 0, first: int = 24, then: int = 6):
    """Rounds of ``chats`` conversations resent whole and ``sessions`` streaming sessions sending their new tokens
    only (``first`` tokens, then ``then`` a turn, answers of ``then``), round robin, one request at a time.
    Returns the chats' (cached, prompt) tokens per request (rounds 2 on), and the server's metrics text."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, 90) for _ in range(n)]  # noqa: E731
    histories = [words(first) for _ in range(chats)]
    seen = []
    async with serving(engine) as c:
        async def chat(r, k):
            b = (await c.post("/generate", json={"input_ids": histories[k], "sampling_params": {
                "max_new_tokens": then, **GREEDY}})).json()
            if r:
                seen.append((b["meta_info"]["cached_tokens"], len(histories[k])))
            histories[k] = histories[k] + b["output_ids"] + words(then)

        async def turn(r, k):
            sp = {"id": f"s{k}", **({"open": True, "streaming": True} if r == 0 else {})}
            b = await c.post("/generate", json={"input_ids": words(first if r == 0 else then), "session_params": sp,
                                                "sampling_params": {"max_new_tokens": then, **GREEDY}})
            assert b.status_code == 200, b.text

        for r in range(rounds):
            for k in range(max(chats, sessions)):
                for f, n in ((chat, chats), (turn, sessions)):
                    if k < n:
                        await f(r, k)
        metrics = (await c.get("/metrics")).text
    return seen, metrics


def _ratio(seen):
    return sum(hit for hit, _ in seen) / sum(n for _, n in seen)


def test_persisted_sessions_leave_ordinary_chats_their_hits(tiny_ckpt, tmp_path):
    """Six resent chats and four streaming sessions on a small pool (8 slots, a host tier of 5 snapshots, a
    storage tier): with --session-persist the chats' hit ratio stays within 10% of its value without. (The issue
    saw 0.71 -> 0.11-0.14 in a concurrent run; sent concurrently the ratio here varies from run to run, so this
    sends one request at a time; benchmarks/multiturn.py --sessions N --variant=--session-persist measures the
    concurrent case.)"""
    per = make_engine(tiny_ckpt).pool.bytes_per_slot
    kw = dict(mamba_cache_size=8, host_cache_size=5 * per, max_running_requests=4, context_length=512)
    off, _ = run(_workload(make_engine(tiny_ckpt, storage_dir=str(tmp_path / "off"), **kw), 6, 4, 5))
    on, _ = run(_workload(make_engine(tiny_ckpt, storage_dir=str(tmp_path / "on"), session_persist=True, **kw),
                          6, 4, 5))
    assert _ratio(off) > 0.5, off
    assert _ratio(on) >= 0.9 * _ratio(off), (_ratio(on), _ratio(off))


def test_round_robin_chats_over_room_for_their_latest_states_all_hit(tiny_ckpt):
    """Twelve chats sent round robin on 8 slots and a host tier of 34 snapshots: room for every chat's latest
    state, so every chat hits from round 2 on (before: the last two of each round missed, their states evicted
    for earlier turns of the chats sent before them)."""
    per = make_engine(tiny_ckpt).pool.bytes_per_slot
    seen, metrics = run(_workload(make_engine(tiny_ckpt, mamba_cache_size=8, host_cache_size=34 * per,
                                              max_running_requests=4, context_length=512, chunked_prefill_size=512),
                                  12, 0, 4, first=64, then=16))
    assert all(hit > 0 for hit, _ in seen), seen


def test_capacity_misses_are_counted_in_every_tier(tiny_ckpt):
    """Twelve chats over room for six of their states (3 slots, a host tier of 3): every token a chat had
    cached and then missed is a capacity miss (its state went through the device and the host tier before
    it was dropped), none is counted as compulsory."""
    per = make_engine(tiny_ckpt).pool.bytes_per_slot
    seen, metrics = run(_workload(make_engine(tiny_ckpt, mamba_cache_size=3, host_cache_size=3 * per,
                                              max_running_requests=2, context_length=512), 12, 0, 3))
    missed = sum(n - 6 - hit for hit, n in seen)  # (the new question of 6 tokens is never cached)
    assert missed > 0
    # (a state covers its answer but its last token when no step ran that one: a token per request)
    assert _counter(metrics, "mambaserve_prefix_cache_capacity_miss_tokens_total") >= missed - len(seen)

