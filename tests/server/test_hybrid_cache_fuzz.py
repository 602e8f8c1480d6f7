"""Hybrid models' cache features together, under a randomized workload: the host tier (evicted Mamba snapshots
in host memory, their KV kept marked in the device tree), rolling decode snapshots, KV-page pressure, streaming
sessions, aborts mid-decode, ``/flush_cache`` while requests run, ``max_new_tokens`` 0 and 1, page sizes 1, 4
and 16, overlap scheduling on and off, a storage tier (entries holding their KV) with persisted sessions or none. Every greedy output equals the cold engine's (no radix cache) for the
same full prompt; the invariant check runs after every step; at the end every slot, host slot and KV page is
free or the cache's. ``FUZZ_SEEDS=N`` runs seeds 0..N-1 (the suite runs 2)."""

import asyncio
import os
import random

import pytest

from mambaserve.server.cache.radix_tree import CacheBusyError
from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.engine import Engine
from mambaserve.server.engine.request import SamplingParams
from mambaserve.server.sessions.table import TurnParams
from tests.server.conftest import assert_idle, checked_accounting, run_started

SEEDS = range(int(os.environ.get("FUZZ_SEEDS", "2")))


def _config(path, rng):
    page = rng.choice([1, 4, 4, 16])
    cfg = dict(model=str(path), device="cpu", context_length=64, debug_cache_invariants=True, page_size=page,
               chunked_prefill_size=rng.choice([8, 16, 32]), max_running_requests=rng.choice([2, 3]),
               mamba_cache_size=rng.choice([3, 4, 6, 8]), max_total_tokens=rng.choice([96, 128, 192]),
               disable_overlap_schedule=rng.random() < 0.4)
    return cfg


def _words(rng, n):
    return [rng.randrange(3, 90) for _ in range(n)]


async def _run(engine, prompt, n, sid=None, cut=None, logprobs_from=-1):
    """Greedy ``n`` tokens; with ``cut`` the client goes away after that many (an abort mid-decode; 0: before
    the first output). ``logprobs_from``: the prompt's logprobs from there on (a session's live state is
    past them: it gives it up to the cache)."""
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    gen = engine.generate(prompt, params, session_id=sid, turn_params=TurnParams() if sid else None,
                          return_logprob=logprobs_from >= 0, logprob_start_len=logprobs_from)
    ids = []
    if cut == 0:
        await gen.aclose()
        return ids
    async for o in gen:
        assert o.error is None, o.error
        ids += o.token_ids
        if cut is not None and len(ids) >= cut:
            await gen.aclose()
            break
    return ids


async def _client(engine, rng, log):
    """A random script: stateless chats (history resent), prompts sent again, aborts, a streaming session."""
    history = _words(rng, rng.randrange(3, 20))
    sid = None
    if rng.random() < 0.3:
        sid = await engine.open_session(None, True, None, None)
        history = []  # a turn sends its new tokens only
    for _ in range(rng.randrange(2, 7)):
        n = rng.choice([0, 1, 2, 5, 9, 14])
        if sid is not None:
            new = _words(rng, rng.randrange(1, 8))
            if len(history) + len(new) + n >= 60:
                break
            lp = rng.randrange(len(history) + 1) if history and rng.random() < 0.2 else -1
            ids = await _run(engine, new, n, sid=sid, logprobs_from=lp)
            history += new
            log.append((list(history), n, ids, "session"))
            history += ids
            continue
        if len(history) + n >= 60:
            break
        cut = rng.randrange(0, n) if n > 2 and rng.random() < 0.25 else None
        if cut is None and rng.random() < 0.15:  # two answers to one prompt: the second starts from the first's prefill
            params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
            outs = []
            for g in engine.generate_n(list(history), params, 2):
                outs.append([t async for o in g for t in o.token_ids])
            log += [(list(history), n, o, None) for o in outs]
            ids = outs[0]
        else:
            ids = await _run(engine, list(history), n, cut=cut)
            log.append((list(history), n, ids, cut))
        r = rng.random()
        if r < 0.2:
            pass  # the same prompt again next time
        elif r < 0.3 and len(history) > 4:
            history = history[:rng.randrange(2, len(history))] + _words(rng, 3)  # a branch off the middle
        else:
            history += ids + _words(rng, rng.randrange(1, 8))
        if rng.random() < 0.1:
            try:
                await engine.flush_cache()
            except CacheBusyError:
                pass
        await asyncio.sleep(rng.random() * 0.01)
    if sid is not None:
        await engine.close_session(sid)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_workload_matches_the_cold_engine(nemotron, seed, tmp_path):
    rng = random.Random(seed)
    cfg = _config(nemotron, rng)
    cold = Engine(ServerConfig(**{**cfg, "disable_radix_cache": True}))
    per = cold.pool.bytes_per_slot
    # half the seeds with a storage tier below (entries with their KV) and persisted sessions
    storage = dict(storage_dir=str(tmp_path), session_persist=True, cache_prefetch_policy="wait_complete",
                   cache_write_policy=rng.choice(["write_through", "write_back", "write_through_selective"]))
    warm = Engine(ServerConfig(**cfg, host_cache_size=per * rng.choice([2, 3, 6]),
                               **(storage if rng.random() < 0.5 else {})))
    clients = rng.randrange(3, 7)
    rngs = [random.Random(rng.random()) for _ in range(clients)]
    log: list = []

    async def go():
        await asyncio.gather(*[_client(warm, r, log) for r in rngs])
        return checked_accounting(warm)
    acct = run_started(warm, go)
    assert len(log) >= clients
    assert_idle(acct)
    assert acct["rolling_snapshots"] == 0
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"], acct

    async def ref():
        return [await _run(cold, prompt, n) for prompt, n, _, _ in log]
    expected = run_started(cold, ref)
    for (prompt, n, ids, cut), want in zip(log, expected):
        if isinstance(cut, int):
            assert ids == want[:len(ids)], (len(prompt), n, cut, cfg)
        else:
            assert ids == want, (len(prompt), n, cut, cfg)
