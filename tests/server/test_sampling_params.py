"""Frequency, presence and repetition penalties and min_new_tokens: the engine's logits processing against
the formulas, greedy generations against transformers with the same penalties applied by hand, and
refusals of values out of range on every endpoint."""

import types

import pytest
import torch

from mambaserve.server.engine.request import SamplingParams
from mambaserve.server.engine.sampling import Penalties, hold_stops
from tests.server.conftest import make_engine, run, serving
from tests.server.hf_reference import _model

GREEDY = {"temperature": 0, "ignore_eos": True}


def _req(rid, prompt, params, output=(), stops=()):
    return types.SimpleNamespace(rid=rid, prompt_ids=list(prompt), params=params, output_ids=list(output),
                                 pending=None, stop_token_ids=frozenset(stops), finished=False,
                                 constraint=None)


def penalized(logits, prompt, generated, freq, pres, rep):
    """The formula, written out: OpenAI's frequency/presence over generated tokens, then the repetition
    penalty (CTRL, as transformers and SGLang apply it) over prompt and generated tokens."""
    x = logits.clone()
    for t in set(generated):
        x[t] -= freq * generated.count(t) + pres
    for t in set(prompt) | set(generated):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    return x


def test_penalties_follow_the_formula_and_count_on_the_device():
    V = 12
    pen = Penalties(torch.device("cpu"))
    a = _req("a", [1, 2, 3], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.5))
    b = _req("b", [4], SamplingParams())  # not penalized: untouched, no row
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    generated = []
    for step in range(4):
        x = logits.clone()
        pairs = pen.apply(x, [a, b])
        assert [j for j, _ in pairs] == [0] and torch.equal(x[1], logits[1])
        torch.testing.assert_close(x[0], penalized(logits[0], a.prompt_ids, generated, 0.5, 0.25, 1.5))
        tok = torch.tensor([5 if step % 2 else 2, 7])
        pen.count(tok, pairs)
        generated.append(int(tok[0]))
    pen.forget("a")
    assert pen.rows == {} and len(pen.free) == 8


def test_min_new_tokens_holds_stop_tokens_until_reached():
    logits = torch.zeros(2, 6)
    early = _req("a", [1], SamplingParams(min_new_tokens=3), output=[5], stops=[0, 4])
    early.pending = object()  # one more sampled, not read yet: 2 so far
    done = _req("b", [1], SamplingParams(min_new_tokens=2), output=[5, 5], stops=[0])
    hold_stops(logits, [early, done])
    assert logits[0, 0] == float("-inf") and logits[0, 4] == float("-inf") and logits[0, 1] == 0
    assert torch.equal(logits[1], torch.zeros(6))


def _hf_penalized_greedy(path, prompt, n, freq, pres, rep):
    model = _model(str(path))
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            tok = int(penalized(logits, prompt, out, freq, pres, rep).argmax())
            out.append(tok)
            ids.append(tok)
    return out


@pytest.mark.parametrize("endpoint", ["/generate", "/v1/completions"])
def test_penalized_greedy_generation_matches_transformers_with_the_formula(tiny_ckpt, endpoint):
    prompt = [5, 9, 14, 9, 23, 5, 31]
    want = _hf_penalized_greedy(tiny_ckpt, prompt, 12, 0.7, 0.4, 1.3)
    plain = _hf_penalized_greedy(tiny_ckpt, prompt, 12, 0.0, 0.0, 1.0)
    assert want != plain  # the penalties change this greedy path: the test can fail

    async def go():
        async with serving(make_engine(tiny_ckpt)) as c:
            native = (await c.post("/generate", json={"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 12, "frequency_penalty": 0.7, "presence_penalty": 0.4,
                "repetition_penalty": 1.3, **GREEDY}})).json()
            if endpoint == "/generate":
                return native["output_ids"], None, None
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "frequency_penalty": 0.7,
                                                      "presence_penalty": 0.4, "repetition_penalty": 1.3, **GREEDY})
            assert r.status_code == 200, r.text
            return native["output_ids"], native["text"], r.json()["choices"][0]["text"]

    ids, native_text, openai_text = run(go())
    assert ids == want
    assert openai_text == native_text  # the OpenAI endpoint applies the same penalties


def test_min_new_tokens_outlasts_a_stop_token(tiny_ckpt):
    prompt = [5, 9, 14]

    async def go():
        async with serving(make_engine(tiny_ckpt)) as c:
            first = (await c.post("/generate", json={"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 6, **GREEDY}})).json()["output_ids"]
            stop = first[0]
            bodies = [{"max_new_tokens": 6, "stop_token_ids": [stop], **GREEDY},
                      {"max_new_tokens": 6, "stop_token_ids": [stop], "min_new_tokens": 4, **GREEDY}]
            outs = [(await c.post("/generate", json={"input_ids": prompt, "sampling_params": b})).json()
                    for b in bodies]
            return stop, outs

    stop, (plain, held) = run(go())
    assert plain["output_ids"] == [stop] and plain["meta_info"]["finish_reason"]["type"] == "stop"
    assert len(held["output_ids"]) >= 4 and stop not in held["output_ids"][:4]


@pytest.mark.parametrize("path,body,needle", [
    ("/generate", {"input_ids": [1], "sampling_params": {"frequency_penalty": 3}}, "frequency_penalty must be in"),
    ("/generate", {"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty must be in"),
    ("/generate", {"input_ids": [1], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "min_new_tokens"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": -2.5}, "presence_penalty must be in"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 9},
     "frequency_penalty must be in"),
])
def test_penalties_out_of_range_are_refused(tiny_ckpt, path, body, needle):
    async def go():
        async with serving(make_engine(tiny_ckpt)) as c:
            return await c.post(path, json=body)

    r = run(go())
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def _hit_tokens(metrics: str) -> float:
    return sum(float(x.split()[-1]) for x in metrics.splitlines()
               if x.startswith("mambaserve_prefix_cache_hit_tokens_total"))


def test_n_answers_share_one_prefill_and_differ_by_seed(tiny_ckpt):
    """n = 3: three choices; the second and third start from the first's prefilled prompt (cache hits of
    len(prompt) - 1 tokens each), and seeds seed, seed+1, seed+2 make them differ, reproducibly."""
    prompt = list(range(3, 40))
    body = {"prompt": prompt, "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 5}

    async def go():
        async with serving(make_engine(tiny_ckpt)) as c:
            before = _hit_tokens((await c.get("/metrics")).text)
            first = (await c.post("/v1/completions", json=body)).json()
            hits = _hit_tokens((await c.get("/metrics")).text) - before
            again = (await c.post("/v1/completions", json=body)).json()
            return first, hits, again

    first, hits, again = run(go())
    texts = [ch["text"] for ch in first["choices"]]
    assert [ch["index"] for ch in first["choices"]] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [ch["text"] for ch in again["choices"]]
    assert hits == 2 * (len(prompt) - 1)  # the copies did not prefill the prompt again
    assert first["usage"]["prompt_tokens"] == len(prompt)  # counted once
    assert first["usage"]["completion_tokens"] == 24


def test_batched_generate_and_chat_n_answer_in_order(tiny_ckpt):
    async def go():
        async with serving(make_engine(tiny_ckpt)) as c:
            single = [(await c.post("/generate", json={"text": t, "sampling_params": {"max_new_tokens": 5, **GREEDY}}
                                    )).json()["text"] for t in ("ab", "xyz")]
            batch = (await c.post("/generate", json={"text": ["ab", "xyz"], "sampling_params": {
                "max_new_tokens": 5, "n": 2, **GREEDY}})).json()
            chat = (await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "n": 2, "max_tokens": 4, **GREEDY})).json()
            return single, batch, chat

    single, batch, chat = run(go())
    assert [b["text"] for b in batch] == [single[0], single[0], single[1], single[1]]
    assert [ch["index"] for ch in chat["choices"]] == [0, 1]
    assert chat["choices"][0]["message"] == chat["choices"][1]["message"]  # greedy: the same answer
    assert chat["usage"]["completion_tokens"] == 8


MSG = [{"role": "user", "content": "x"}]
REFUSED = [
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"messages": MSG, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": MSG, "structural_tag": {"type": "x"}}, "structural_tag"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_regex": "a"}}, "sampling_params.stop_regex"),
    ("/generate", {"input_ids": [1], "lora_path": "adapter"}, "lora_path"),
    ("/generate", {"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
]
# what sglang-router adds to every request it forwards, and no-op values of refused fields: accepted
ROUTER_NOOPS = [
    ("/generate", {"input_ids": [1], "model": None, "return_text_in_logprobs": False, "log_metrics": True,
                   "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
                   "return_entropy": False, "sampling_params": {"max_new_tokens": 2, "regex": None}}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "model": "unknown", "no_stop_trim": False,
                              "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
                              "return_hidden_states": False, "response_format": {"type": "text"}, "tools": []}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2, "best_of": 2, "logit_bias": {}, "suffix": None}),
]


def test_unsupported_fields_are_refused_and_no_op_values_accepted(tiny_ckpt):
    async def go():
        async with serving(make_engine(tiny_ckpt)) as c:
            return ([await c.post(p, json=b) for p, b, _ in REFUSED], [await c.post(p, json=b) for p, b in ROUTER_NOOPS])

    refused, accepted = run(go())
    for r, (_, _, name) in zip(refused, REFUSED):
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "unsupported_parameter" and name in err["message"], r.text
    for r in accepted:
        assert r.status_code == 200, r.text
