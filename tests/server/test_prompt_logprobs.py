"""``logprob_start_len`` / ``input_token_logprobs`` (SGLang's) and ``echo`` with ``logprobs`` (OpenAI's):
the logprobs of the prompt's own tokens, against transformers, with and without the radix cache."""

import json

import pytest

from tests.server.conftest import accounting, assert_idle, make_engine, run, serving
from tests.server.hf_reference import hf_prompt_logprobs

PROMPT = [(3 * k * k + 5 * k + 2) % 90 + 2 for k in range(40)]  # three prefill chunks of 16


def _body(start, top=0, **kw):
    return {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": top,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True, **kw}}


def _expected(tiny_ckpt, start):
    logp = hf_prompt_logprobs(tiny_ckpt, PROMPT)
    return [None if i == 0 else float(logp[i - 1, PROMPT[i]]) for i in range(start, len(PROMPT))], logp


def _check(meta, tiny_ckpt, start, top=0):
    want, logp = _expected(tiny_ckpt, start)
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == PROMPT[start:]
    if start == 0:
        assert got[0][0] is None  # nothing predicts the first token
    assert [lp for lp, _, _ in got if lp is not None] == pytest.approx([w for w in want if w is not None], abs=1e-4)
    if top:
        for i, entries in zip(range(start, len(PROMPT)), meta["input_top_logprobs"]):
            if i == 0:
                assert entries is None
                continue
            vals, ids = logp[i - 1].topk(top)
            assert [t for _, t, _ in entries] == ids.tolist()
            assert [v for v, _, _ in entries] == pytest.approx(vals.tolist(), abs=1e-4)


def test_prompt_logprobs_match_transformers_cold_and_with_a_cache_hit(tiny_ckpt):
    engine = make_engine(tiny_ckpt, context_length=4096)
    cold = make_engine(tiny_ckpt, context_length=4096, disable_radix_cache=True)

    async def go(e, warm):
        async with serving(e) as c:
            if warm:  # the prompt's states at 16, 32 and 39 tokens are in the cache now
                await c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
            out = {s: (await c.post("/generate", json=_body(s, top=3))).json() for s in (0, 20, 39)}
            plain = (await c.post("/generate", json=_body(-1))).json()
            return out, plain, await accounting(e)

    hot, plain, acc = run(go(engine, warm=True))
    cold_out, _, cold_acc = run(go(cold, warm=False))
    for s in (0, 20, 39):
        _check(hot[s]["meta_info"], tiny_ckpt, s, top=3)
        hot_lps = [lp for lp, _, _ in hot[s]["meta_info"]["input_token_logprobs"] if lp is not None]
        cold_lps = [lp for lp, _, _ in cold_out[s]["meta_info"]["input_token_logprobs"] if lp is not None]
        assert hot_lps == pytest.approx(cold_lps, abs=1e-5)
        assert hot[s]["output_ids"] == cold_out[s]["output_ids"] == plain["output_ids"]
    # the cache served what lies before the positions asked for, and no more
    assert [hot[s]["meta_info"]["cached_tokens"] for s in (0, 20, 39)] == [0, 16, 32]
    assert plain["meta_info"]["cached_tokens"] == 39 and "input_token_logprobs" not in plain["meta_info"]
    assert_idle(acc)
    assert_idle(cold_acc)


def test_prompt_logprobs_with_n_and_nothing_to_generate_and_bad_values(tiny_ckpt):
    engine = make_engine(tiny_ckpt, context_length=4096)

    async def go():
        async with serving(engine) as c:
            r = {"n": await c.post("/generate", json=_body(3, n=3, temperature=1, seed=5)),
                 "score": await c.post("/generate", json={**_body(0), "sampling_params": {"max_new_tokens": 0}}),
                 "past": await c.post("/generate", json=_body(40)),
                 "neg": await c.post("/generate", json=_body(-2)),
                 "session": await c.post("/generate", json={**_body(0), "session_params": {"id": "s", "open": True}})}
            r["acc"] = await accounting(engine)
            return r

    r = run(go())
    answers = r["n"].json()
    assert len(answers) == 3 and len({tuple(a["output_ids"]) for a in answers}) > 1
    for a in answers:  # computed once, by the first answer, reported with each
        _check(a["meta_info"], tiny_ckpt, 3)
    score = r["score"].json()
    assert score["output_ids"] == [] and len(score["meta_info"]["input_token_logprobs"]) == len(PROMPT)
    _check(score["meta_info"], tiny_ckpt, 0)
    assert r["past"].status_code == 400 and "logprob_start_len" in r["past"].json()["error"]["message"]
    assert r["neg"].status_code == 400 and "logprob_start_len" in r["neg"].json()["error"]["message"]
    assert r["session"].status_code == 400 and r["acc"]["sessions"] == 0
    assert_idle(r["acc"])


def test_completions_echo_with_logprobs_reports_the_prompts_tokens(tiny_ckpt):
    engine = make_engine(tiny_ckpt, context_length=4096)
    want, logp = _expected(tiny_ckpt, 0)

    async def go():
        async with serving(engine) as c:
            await c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})  # cached
            scored = await c.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 2,
                                                           "max_tokens": 0})
            both = await c.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 0,
                                                         "max_tokens": 3, "temperature": 0})
            plain = await c.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 3,
                                                          "temperature": 0})
            streamed = await c.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 1, "n": 3,
                                                             "max_tokens": 4, "seed": 3, "stream": True})
            return scored.json(), both.json(), plain.json(), streamed.text, await accounting(engine)

    scored, both, plain, streamed, acc = run(go())
    firsts = {}
    for line in streamed.splitlines():
        if line.startswith("data: {"):
            ch = json.loads(line[6:])["choices"][0]
            firsts.setdefault(ch["index"], ch)
    assert sorted(firsts) == [0, 1, 2]
    for ch in firsts.values():  # every choice's first chunk: the prompt, its logprobs (computed once), a token
        assert ch["text"].startswith(engine.tokenizer.decode(PROMPT))
        assert ch["logprobs"]["token_logprobs"][0] is None
        assert ch["logprobs"]["token_logprobs"][1:len(PROMPT)] == pytest.approx(want[1:], abs=1e-4)
    text = engine.tokenizer.decode(PROMPT)
    ch = scored["choices"][0]
    assert ch["text"] == text and scored["usage"]["completion_tokens"] == 0
    lp = ch["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want[1:], abs=1e-4)
    assert lp["tokens"] == [engine.tokenizer.decode([t]) for t in PROMPT]
    assert lp["text_offset"][-1] == len(text) - len(lp["tokens"][-1])
    top_ids = logp[5].topk(2).indices.tolist()
    assert list(lp["top_logprobs"][6]) == [engine.tokenizer.decode([t]) for t in top_ids]
    ch = both["choices"][0]
    assert ch["text"] == plain["choices"][0]["text"] and ch["text"].startswith(text)
    assert len(ch["logprobs"]["tokens"]) == len(PROMPT) + 3
    assert ch["logprobs"]["text_offset"][len(PROMPT)] == len(text)  # the answer's offsets follow the prompt's
    assert_idle(acc)


def test_prompt_logprobs_are_computed_in_bounded_steps(tiny_ckpt, monkeypatch):
    """A long prompt's logits are taken a bounded number of positions per step (PROMPT_LOGITS_PER_STEP),
    over as many steps as needed, with the same values."""
    from mambaserve.server.engine import admission

    monkeypatch.setattr(admission, "PROMPT_LOGITS_PER_STEP", 7)
    engine = make_engine(tiny_ckpt, context_length=4096, chunked_prefill_size=64)

    async def go():
        async with serving(engine) as c:
            r = await c.post("/generate", json=_body(2, top=2))
            return r.json(), engine.scheduler.steps, await accounting(engine)

    out, steps, acc = run(go())
    _check(out["meta_info"], tiny_ckpt, 2, top=2)
    assert steps >= len(PROMPT) // 7  # (one 64-token chunk would have taken the prompt in one step)
    assert_idle(acc)
