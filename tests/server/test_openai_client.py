"""The official OpenAI Python client against a real server: streamed n > 1 choices with logprobs, echo,
models.retrieve and a session through extra_headers / extra_body (what sglang-router users send)."""

import pytest

openai = pytest.importorskip("openai")  # pinned in requirements.txt; absent where only the engine is installed

from tests.server.conftest import accounting, assert_idle, make_engine, run, uvicorn_server


@pytest.fixture(scope="module")
def served(tiny_ckpt):
    engine = make_engine(tiny_ckpt, context_length=4096, max_running_requests=8, mamba_cache_size=12)
    with uvicorn_server(engine) as url:
        yield engine, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_streamed_choices_logprobs_and_echo(served):
    engine, client = served
    model = client.models.retrieve("tiny").id
    texts, finish, logprobs, usage = {}, {}, {}, None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "def main():"}], n=2, max_tokens=10, seed=4,
            stream=True, logprobs=True, top_logprobs=2, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            logprobs[ch.index] = logprobs.get(ch.index, 0) + len(ch.logprobs.content if ch.logprobs else [])
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "def main():"}],
                                           n=2, max_tokens=10, seed=4)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finish == {0: "length", 1: "length"} and logprobs == {0: 10, 1: 10}
    assert usage.completion_tokens == 20 and usage.prompt_tokens == whole.usage.prompt_tokens

    echoed = {}
    for chunk in client.completions.create(model=model, prompt="import os\n", n=2, max_tokens=4, stream=True,
                                           echo=True, logprobs=1, seed=9):
        for ch in chunk.choices:
            echoed.setdefault(ch.index, []).append(ch)
    for chunks in echoed.values():
        assert chunks[0].text.startswith("import os\n")
        first = engine.tokenizer.decode(engine.encode("import os\n")[:1])
        assert chunks[0].logprobs.token_logprobs[0] is None and chunks[0].logprobs.tokens[0] == first
        assert chunks[-1].finish_reason == "length"
    scored = client.completions.create(model=model, prompt="import os\n", max_tokens=0, echo=True, logprobs=1)
    assert scored.choices[0].text == "import os\n" and scored.usage.completion_tokens == 0
    assert_idle(run(accounting(engine)))


def test_a_session_through_extra_headers_and_extra_body(served):
    engine, client = served
    sid, turns, out = "sdk-1", ["def add(a, b):", "\n    return", "\n\ndef sub(a, b):"], []
    for i, text in enumerate(turns):
        sp = {"open": True, "streaming": True} if i == 0 else {"close": True} if i == len(turns) - 1 else {}
        r = client.completions.create(model="tiny", prompt=text, max_tokens=6, temperature=0,
                                      extra_headers={"x-smg-routing-key": sid}, extra_body={"session_params": sp})
        out.append(r)
    history = ""
    for text, r in zip(turns, out):
        history += text
        ref = client.completions.create(model="tiny", prompt=history, max_tokens=6, temperature=0)
        assert r.choices[0].text == ref.choices[0].text  # the session kept the history
        history += r.choices[0].text
    assert out[2].usage.prompt_tokens_details.cached_tokens == out[1].usage.total_tokens
    with pytest.raises(openai.NotFoundError, match="does not exist on this server"):
        client.completions.create(model="tiny", prompt="x", extra_headers={"x-smg-routing-key": sid},
                                  extra_body={"session_params": {}})
    assert run(accounting(engine))["sessions"] == 0
