"""Hybrid models through the engine without the radix cache (tests/server/test_hybrid_radix.py has it): continuous batching, chunked prefill and
decode give transformers' greedy outputs; KV pages and slots all come back; the features not built
for hybrids are refused with the reason, before anything runs."""

import asyncio
import functools
from pathlib import Path

import pytest
import torch

from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.engine import Engine
from mambaserve.server.engine.request import SamplingParams
from tests.server.tiny_hybrids import make_hybrid_checkpoint


def _engine(path, **kw):
    cfg = dict(model=str(path), device="cpu", disable_radix_cache=True, context_length=256,
               debug_cache_invariants=True, chunked_prefill_size=7, max_running_requests=3)
    return Engine(ServerConfig(**{**cfg, **kw}))


@functools.cache
def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_greedy(path, prompt, n):
    out = _hf(str(path)).generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  eos_token_id=None)
    return out[0, len(prompt):].tolist()


async def _generate(engine, prompts, n):
    async def one(p):
        ids = []
        async for o in engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)):
            ids += o.token_ids
        return ids
    return await asyncio.gather(*[one(p) for p in prompts])


@pytest.mark.parametrize("family,page_size", [("nemotron_h", 1), ("granite_moe", 4), ("bamba", 16)])
def test_greedy_generation_equals_transformers(tmp_path, family, page_size):
    """Four prompts on three running slots (one waits for a slot and for pages), prompts longer than the
    7-token prefill chunk, decode batched: every output equals transformers' generate."""
    path = make_hybrid_checkpoint(tmp_path / family, family)
    engine = _engine(path, page_size=page_size)
    engine.start()
    try:
        prompts = [list(range(5, 16)), [20, 21, 22], [30] * 17, [40, 41, 42, 43, 44]]
        outs = asyncio.run(_generate(engine, prompts, 6))
        acct = asyncio.run(engine.accounting())
    finally:
        engine.stop()
    for p, out in zip(prompts, outs):
        assert out == _hf_greedy(path, p, 6), p
    assert acct["kv_pages_free"] == acct["kv_pages"] and acct["free"] == acct["capacity"]


def test_pages_scarce_requests_wait_not_fail(tmp_path):
    """A KV pool of one context (the plan's floor) for 3 running slots: requests take turns for pages."""
    path = make_hybrid_checkpoint(tmp_path / "g", "granite_dense_rope")
    engine = _engine(path, page_size=4, context_length=40, max_total_tokens=40)  # exactly one context
    engine.start()
    try:
        prompts = [[7] * 20, [8] * 12, [9] * 25]
        outs = asyncio.run(_generate(engine, prompts, 5))
        acct = asyncio.run(engine.accounting())
    finally:
        engine.stop()
    for p, out in zip(prompts, outs):
        assert out == _hf_greedy(path, p, 5)
    assert acct["kv_pages"] == acct["kv_pages_free"] == 10 and tuple(engine.kv_pool.k.shape[1:3]) == (10, 4)


def test_hybrid_flags_and_their_limits(tmp_path):
    path = make_hybrid_checkpoint(tmp_path / "nh", "nemotron_h")
    assert _engine(path, host_cache_size=2**20, disable_radix_cache=False).scheduler.cache.host is not None
    with pytest.raises(ValueError, match=r"--max-total-tokens \(13 pages of 16 tokens\) holds less than one request of --context-length 256"):
        _engine(path, max_total_tokens=200)
    engine = _engine(path)
    assert engine.cfg.page_size == 16 and engine.kv_pool.page_size == 16  # the hybrid default


def test_aborts_and_bad_requests_give_every_page_back(tmp_path):
    """A request closed mid-generation, one aborted while it waits for pages, and an out-of-range prompt:
    every KV page and slot is free afterwards and the next request still equals transformers."""
    path = make_hybrid_checkpoint(tmp_path / "g", "granite_moe")
    # one 64-token context: the second request waits for pages
    engine = _engine(path, page_size=4, context_length=64, max_total_tokens=64)

    async def go():
        params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        first = engine.generate([5] * 20, params)
        waiting = engine.generate([6] * 20, params)  # needs 15 pages while the first holds 15
        got = 0
        async for out in first:
            got += len(out.token_ids)
            if got >= 3:
                break
        await first.aclose()  # the client went away mid-generation
        await waiting.aclose()  # and this one before it ever ran
        with pytest.raises(Exception, match="out of range"):
            engine.check_prompt([10**6], SamplingParams(), False)
        return await _generate(engine, [[9, 8, 7]], 4), await engine.accounting()

    engine.start()
    try:
        (out,), acct = asyncio.run(go())
        engine.scheduler.call(engine.scheduler.check_invariants).result(timeout=10)
    finally:
        engine.stop()
    assert out == _hf_greedy(path, [9, 8, 7], 4)
    assert acct["kv_pages_free"] == 16 and acct["free"] == acct["capacity"]


def test_the_configs_eos_stops_generation(tmp_path):
    """config.json's eos_token_id (not the tokenizer's) ends a greedy generation where transformers' would."""
    import json

    path = make_hybrid_checkpoint(tmp_path / "b", "bamba")
    prompt = [30, 31, 32]
    full = _hf_greedy(path, prompt, 8)
    eos = full[3]
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(cfg))
    engine = _engine(path)
    engine.start()
    try:
        async def go():
            ids = []
            async for o in engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0.0)):
                ids += o.token_ids
            return ids
        out = asyncio.run(go())
    finally:
        engine.stop()
    assert eos in engine.eos_token_ids and out == full[:full.index(eos) + 1]


def test_random_traffic_with_aborts_on_scarce_pages(tmp_path):
    """Twelve requests of random lengths on 3 running slots and two contexts' worth of pages (5-token prefill
    chunks, invariants checked after every step), three closed early: every finished one equals
    transformers, and every page and slot comes back."""
    import random

    rng = random.Random(1)
    path = make_hybrid_checkpoint(tmp_path / "nh", "nemotron_h")
    engine = _engine(path, page_size=4, context_length=48, chunked_prefill_size=5, max_total_tokens=96)
    jobs = [([rng.randrange(1, 90) for _ in range(rng.randrange(1, 31))], rng.randrange(1, 11)) for _ in range(12)]
    early = {2, 5, 9}

    async def one(i, prompt, n):
        gen = engine.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        ids = []
        async for out in gen:
            ids += out.token_ids
            if i in early and ids:
                await gen.aclose()
                return None
        return ids

    async def go():
        outs = await asyncio.gather(*[one(i, p, n) for i, (p, n) in enumerate(jobs)])
        return outs, await engine.accounting()

    engine.start()
    try:
        outs, acct = asyncio.run(go())
    finally:
        engine.stop()
    for (prompt, n), out in zip(jobs, outs):
        if out is not None:
            assert out == _hf_greedy(path, prompt, n)
    assert acct["kv_pages_free"] == 24 and acct["free"] == acct["capacity"] and not acct["running"]


def test_a_tokenizer_larger_than_the_vocabulary_is_warned_about(tmp_path, caplog):
    """Pairing a model with another model's tokenizer: said at start, not only by each refused request."""
    path = make_hybrid_checkpoint(tmp_path / "g", "granite_dense_rope")
    with caplog.at_level("WARNING", logger="mambaserve.server.engine.engine"):
        _engine(path)
        assert not [r for r in caplog.records if "tokenizer has" in r.message]
        bundled = Path(__file__).resolve().parents[2] / "models" / "mamba2-tiny-pystdlib"
        _engine(path, tokenizer=str(bundled))
    assert any("the tokenizer has 4096 tokens but the model's vocabulary 96" in r.message for r in caplog.records)


def test_a_context_longer_than_the_checkpoints_is_warned_about(tmp_path, caplog):
    """--context-length past the checkpoint's max_position_embeddings (2048 here) serves, as asked, but says
    at start that positions past it are beyond what the model was built for (RoPE families extrapolate)."""
    path = make_hybrid_checkpoint(tmp_path / "g", "granite_dense_rope")
    with caplog.at_level("WARNING", logger="mambaserve.server.engine.engine"):
        _engine(path, context_length=2048)
        assert not [r for r in caplog.records if "max_position_embeddings" in r.message]
        engine = _engine(path, context_length=4096)
    assert engine.context_length == 4096
    assert any("--context-length 4096 is longer than the checkpoint's max_position_embeddings 2048" in r.message
               for r in caplog.records)
