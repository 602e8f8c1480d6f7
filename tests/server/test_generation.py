"""End-to-end generation through the HTTP app against transformers (greedy ids and logprobs)."""

import asyncio

import pytest

from tests.server.conftest import accounting, assert_idle, make_engine, run, serving
from tests.server.hf_reference import hf_greedy
from tests.server.tiny_models import VOCAB

PROMPTS = [[(7 * i + 3 * k) % (VOCAB - 1) + 1 for k in range(n)] for i, n in enumerate([1, 5, 16, 17, 40, 3])]


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt)


def test_concurrent_greedy_requests_match_transformers(engine, tiny_ckpt):
    n = 6

    async def go():
        async with serving(engine) as c:
            rs = await asyncio.gather(*[
                c.post("/generate", json={"input_ids": p, "return_logprob": True, "sampling_params": {
                    "max_new_tokens": n, "temperature": 0, "ignore_eos": True}}) for p in PROMPTS])
            return rs, await accounting(engine)

    rs, acc = run(go())
    assert_idle(acc)
    for prompt, r in zip(PROMPTS, rs):
        assert r.status_code == 200, r.text
        body = r.json()
        ref_ids, ref_lps = hf_greedy(tiny_ckpt, prompt, n)
        assert body["output_ids"] == ref_ids
        got = [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(ref_lps, abs=1e-4)
        assert body["meta_info"]["prompt_tokens"] == len(prompt)
        assert body["meta_info"]["completion_tokens"] == n
        assert body["meta_info"]["finish_reason"] == {"type": "length"}


def test_seeded_sampling_is_reproducible_and_batch_invariant(engine):
    body = {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9,
                                                         "top_k": 20, "sampling_seed": 1234, "ignore_eos": True}}

    async def go():
        async with serving(engine) as c:
            alone = (await c.post("/generate", json=body)).json()["output_ids"]
            others = [c.post("/generate", json={"input_ids": p, "sampling_params": {"max_new_tokens": 12}})
                      for p in PROMPTS]
            together = await asyncio.gather(c.post("/generate", json=body), *others)
            other_seed = {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 99}}
            different = (await c.post("/generate", json=other_seed)).json()["output_ids"]
            return alone, together[0].json()["output_ids"], different

    alone, together, different = run(go())
    assert alone == together
    assert alone != different


def test_top_k_one_is_greedy_and_stop_strings_cut_text(engine, tiny_ckpt):
    prompt = PROMPTS[4]
    ref_ids, _ = hf_greedy(tiny_ckpt, prompt, 10)
    ref_text = engine.tokenizer.decode(ref_ids)
    stop = ref_text[4:6]

    async def go():
        async with serving(engine) as c:
            k1 = await c.post("/generate", json={"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 10, "temperature": 0.7, "top_k": 1, "ignore_eos": True}})
            stopped = await c.post("/generate", json={"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 10, "temperature": 0, "stop": [stop], "ignore_eos": True}})
            by_id = await c.post("/generate", json={"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 10, "temperature": 0, "stop_token_ids": [ref_ids[3]], "ignore_eos": True}})
            return k1.json(), stopped.json(), by_id.json()

    k1, stopped, by_id = run(go())
    assert k1["output_ids"] == ref_ids
    first = ref_text.find(stop)
    assert stopped["text"] == ref_text[:first]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    cut = ref_ids.index(ref_ids[3])
    assert by_id["output_ids"] == ref_ids[:cut + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref_ids[3]}
    assert by_id["text"] == engine.tokenizer.decode(ref_ids[:cut])


def test_openai_endpoints_agree_with_native(engine, tiny_ckpt):
    text = "def f(x):"
    ids = engine.encode(text)
    ref_ids, ref_lps = hf_greedy(tiny_ckpt, ids, 8)

    async def go():
        async with serving(engine) as c:
            comp = await c.post("/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 8,
                                                         "temperature": 0, "ignore_eos": True, "logprobs": 3})
            chat = await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
                "logprobs": True, "top_logprobs": 2})
            models = await c.get("/v1/models")
            return comp.json(), chat.json(), models.json()

    comp, chat, models = run(go())
    choice = comp["choices"][0]
    assert choice["text"] == engine.tokenizer.decode(ref_ids)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(ref_lps, abs=1e-4)
    assert all(len(t) == 3 for t in choice["logprobs"]["top_logprobs"])
    assert comp["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 8, "total_tokens": len(ids) + 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    chat_prompt = engine.encode("<user>hi\n<assistant>")
    assert chat["usage"]["prompt_tokens"] == len(chat_prompt)
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert len(chat["choices"][0]["logprobs"]["content"]) == chat["usage"]["completion_tokens"]
    assert models["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("cache", [True, False])
def test_zero_max_new_tokens_runs_the_prompt_only(tiny_ckpt, cache):
    engine = make_engine(tiny_ckpt, disable_radix_cache=not cache)

    async def go():
        async with serving(engine) as c:
            rs = [await c.post("/generate", json={"input_ids": p, "sampling_params": {"max_new_tokens": 0}})
                  for p in (PROMPTS[3], PROMPTS[3], [7])]  # cold, fully cached, one token
            return [r.json() for r in rs], await accounting(engine)

    bodies, acc = run(go())
    for body in bodies:
        assert body["output_ids"] == [] and body["meta_info"]["finish_reason"] == {"type": "length"}
        assert body["meta_info"]["completion_tokens"] == 0
    assert_idle(acc)
