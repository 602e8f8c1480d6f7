"""The radix cache inside the engine: hits reproduce cold results exactly, and memory stays accounted."""

import asyncio

import pytest

from tests.server.conftest import accounting, assert_idle, make_engine, run, serving

GREEDY = {"temperature": 0, "ignore_eos": True}


def _prompt(n, seed):
    return [(seed * 31 + 7 * k * k + k) % 94 + 1 for k in range(n)]


async def _gen(c, ids, n=6, **extra):
    r = await c.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                        "sampling_params": {"max_new_tokens": n, **GREEDY}, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["output_ids"], [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]], \
        body["meta_info"]["cached_tokens"]


@pytest.fixture(scope="module")
def cold(tiny_ckpt):
    return make_engine(tiny_ckpt, disable_radix_cache=True)


def test_hits_reproduce_cold_outputs_and_chat_turns_reuse_history(tiny_ckpt, cold):
    warm = make_engine(tiny_ckpt)
    p1 = _prompt(21, 1)

    async def go(engine):
        async with serving(engine) as c:
            o1, lp1, c1 = await _gen(c, p1)
            again = await _gen(c, p1)  # the same prompt twice
            p2 = p1 + o1 + _prompt(9, 2)  # turn 2: history + answer + new question
            o2, lp2, c2 = await _gen(c, p2)
            p3 = p2 + o2 + _prompt(4, 3)
            o3, lp3, c3 = await _gen(c, p3)
            return (o1, lp1, c1), again, (o2, lp2, c2), (o3, lp3, c3), await accounting(engine)

    w = run(go(warm))
    k = run(go(cold))
    for (wo, wlp, _), (ko, klp, kc) in zip(w[:4], k[:4]):
        assert wo == ko
        assert wlp == pytest.approx(klp, abs=1e-5)
        assert kc == 0
    (o1, _, c1), again, (o2, _, c2), (_, _, c3) = w[:4]
    assert c1 == 0
    assert again[2] == len(p1) - 1  # prompt minus its last token, which must run for logits
    # a turn reuses the whole history: the step launched while the last token was read ran it
    assert c2 == len(p1) + len(o1)
    assert c3 == len(p1) + len(o1) + 9 + len(o2)
    assert_idle(w[4])


def test_the_prompt_runs_once_and_its_last_chunk_samples_and_snapshots(tiny_ckpt):
    """A cold prompt's tokens each run once, in prefill: the chunk with its last token samples the first
    output token and writes the state before that token into a snapshot slot in the same pass (no
    separate step for the last token), and the same prompt sent again hits that snapshot."""
    engine = make_engine(tiny_ckpt, chunked_prefill_size=16)
    runner = engine.scheduler.runner
    batches = []
    forward = runner.forward
    runner.forward = lambda batch: batches.append(batch) or forward(batch)
    p = _prompt(21, 6)

    async def go():
        async with serving(engine) as c:
            first = await _gen(c, p, n=3)
            ran = list(batches)
            again = await _gen(c, p, n=3)
            return first, ran, again, await accounting(engine)

    first, ran, again, acc = run(go())
    extends = [b for b in ran if b.mode.name == "EXTEND"]
    assert [b.seq_lens for b in extends] == [[16], [5]]
    assert extends[0].snap == [] and len(extends[1].snap) == 1
    assert sum(b.batch_size for b in ran if b.mode.name == "DECODE") <= 3  # 2 more tokens (+1 overlapped row)
    assert again[2] == len(p) - 1 and again[0] == first[0]
    assert_idle(acc)


def test_chunk_ends_are_snapshots(tiny_ckpt):
    engine = make_engine(tiny_ckpt, chunked_prefill_size=16)
    long = _prompt(40, 4)

    async def go():
        async with serving(engine) as c:
            await _gen(c, long, n=1)
            branch = long[:20] + _prompt(7, 5)  # shares 20 tokens: chunk ends at 16 and 32
            _, _, cached = await _gen(c, branch, n=1)
            return cached, await accounting(engine)

    cached, acc = run(go())
    assert cached == 16
    assert_idle(acc)


def test_extra_buffer_tracks_every_interval(tiny_ckpt, cold):
    n = 8  # the tiny model's chunk size
    engine = make_engine(tiny_ckpt, mamba_cache_strategy="extra_buffer", mamba_track_interval=n,
                         chunked_prefill_size=256, mamba_cache_size=16)
    shared = _prompt(3 * n + 5, 6)
    a, b = shared + _prompt(9, 7), shared + _prompt(6, 8)

    async def go(e):
        async with serving(e) as c:
            ra = await _gen(c, a)
            rb = await _gen(c, b)
            return ra, rb, await accounting(e)

    ra, rb, acc = run(go(engine))
    ka, kb, _ = run(go(cold))
    assert rb[2] == 3 * n
    assert (ra[0], rb[0]) == (ka[0], kb[0])
    assert rb[1] == pytest.approx(kb[1], abs=1e-5)
    assert_idle(acc)


def test_memory_pressure_evicts_and_never_leaks(tiny_ckpt, cold):
    engine = make_engine(tiny_ckpt, mamba_cache_size=3, max_running_requests=3, chunked_prefill_size=8)
    prompts = [_prompt(5 + (i * 7) % 23, 10 + i) for i in range(24)]

    async def go(e):
        async with serving(e) as c:
            results = await asyncio.gather(*[_gen(c, p, n=4) for p in prompts])
            again = await asyncio.gather(*[_gen(c, p, n=4) for p in prompts[:6]])
            return results, again, await accounting(e), (await c.get("/metrics")).text

    results, again, acc, metrics = run(go(engine))
    ref, _, _, _ = run(go(cold))
    assert [r[0] for r in results] == [r[0] for r in ref]
    assert [r[0] for r in again] == [r[0] for r in ref[:6]]
    assert_idle(acc)
    evictions = next(line for line in metrics.splitlines() if line.startswith("mambaserve_cache_evictions_total"))
    assert float(evictions.split()[-1]) > 0
    # the snapshots the tree holds, in bytes, without a host tier too
    gpu = 'mambaserve_cache_tier_used_bytes{tier="gpu"}'
    used = next(line for line in metrics.splitlines() if line.startswith(gpu))
    assert float(used.split()[-1]) == acc["held_by_tree"] * engine.scheduler.runner.slot_bytes > 0


def test_flush_cache_refused_while_running_then_empties_the_tree(tiny_ckpt):
    engine = make_engine(tiny_ckpt, context_length=8192)

    async def go():
        async with serving(engine) as c:
            await _gen(c, _prompt(12, 20))
            task = asyncio.ensure_future(c.post("/generate", json={"input_ids": _prompt(5, 21), "rid": "long",
                                                                   "sampling_params": {"max_new_tokens": 5000, **GREEDY}}))
            while (await c.get("/get_server_info")).json()["internal_states"][0]["running"] == 0:
                await asyncio.sleep(0.01)
            busy = await c.post("/flush_cache")
            await c.post("/abort_request", json={"rid": "long"})
            await task
            before = await accounting(engine)
            ok = await c.post("/flush_cache")
            after = await accounting(engine)
            metrics = (await c.get("/metrics")).text
            return busy, ok, before, after, metrics

    busy, ok, before, after, metrics = run(go())
    assert busy.status_code == 409 and "while 1 requests run" in busy.json()["error"]["message"]
    assert before["held_by_tree"] > 0
    assert ok.status_code == 200 and ok.json()["freed_snapshots"] == before["held_by_tree"]
    assert after["held_by_tree"] == 0 and after["free"] == after["capacity"]
    assert "mambaserve_prefix_cache_queried_tokens_total 17.0" in metrics  # 12 + 5 prompt tokens looked up
