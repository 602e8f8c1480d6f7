"""The fields agent and RAG frameworks send, through the official OpenAI client and plain HTTP: sampling
controls (logit_bias, allowed_token_ids, bad_words, include_stop_str_in_output), chat rendering
(chat_template_kwargs, add_generation_prompt, continue_final_message, echo), prompt_logprobs,
truncate_prompt_tokens, chat without max_tokens, strict types, and /tokenize, /detokenize, /version."""

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.server.conftest import accounting, assert_idle, make_engine, run, uvicorn_server  # noqa: E402
from tests.server.tiny_models import make_checkpoint  # noqa: E402

# (the tiny byte vocabulary has no newline)
TEMPLATE = ("{{ greeting | default('') }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MSG = [{"role": "user", "content": "abc"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("fields"), "h6_g1", chat_template=TEMPLATE)
    engine = make_engine(ckpt, context_length=96)
    with uvicorn_server(engine) as url:
        yield engine, url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert_idle(run(accounting(engine)))


def ids_of(engine, text):
    return engine.encode(text)


def test_logit_bias_allowed_tokens_and_bad_words(served):
    engine, url, client = served
    x = ids_of(engine, "x")[0]
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0, logit_bias={str(x): 100})
    assert r.choices[0].text == "x" * 6
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=1.0, seed=2,
                                  extra_body={"allowed_token_ids": ids_of(engine, "ab")})
    assert set(r.choices[0].text) <= {"a", "b"} and len(r.choices[0].text) == 8
    native = httpx.post(f"{url}/generate", json={"text": "hello", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "logit_bias": {str(x): 100}}}).json()
    assert native["text"] == "xxxx"
    # a word the greedy answer writes, then banned (one token: masked; two: masked after its first)
    plain = client.completions.create(model="tiny", prompt="hello", max_tokens=24, temperature=0).choices[0].text
    word = plain[2:4]
    banned = client.completions.create(model="tiny", prompt="hello", max_tokens=24, temperature=0,
                                       extra_body={"bad_words": [word, plain[0]]}).choices[0].text
    assert word not in banned and plain[0] not in banned and banned != plain


def test_stop_strings_can_stay_in_the_text(served):
    _, url, client = served
    plain = client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0).choices[0].text
    stop = plain[4:6]
    cut = client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0, stop=[stop])
    kept = client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].text + stop == kept.choices[0].text == plain[:plain.index(stop) + 2]
    native = httpx.post(f"{url}/generate", json={"text": "hello", "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "stop": [stop], "no_stop_trim": True}}).json()
    assert native["text"] == kept.choices[0].text


def test_chat_rendering_fields(served):
    _, url, client = served

    def rendered(**body):
        r = httpx.post(f"{url}/tokenize", json={"messages": MSG, **body})
        assert r.status_code == 200, r.text
        return httpx.post(f"{url}/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]

    assert rendered() == "<user>abc<assistant>"
    assert rendered(add_generation_prompt=False) == "<user>abc"
    assert rendered(chat_template_kwargs={"greeting": "hi!"}) == "hi!<user>abc<assistant>"
    r = httpx.post(f"{url}/tokenize", json={"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]
    # continue_final_message: the assistant's message is continued, and echo returns it first
    convo = MSG + [{"role": "assistant", "content": "de"}]
    r = client.chat.completions.create(model="tiny", messages=convo, max_tokens=4, temperature=0,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True,
                                                   "echo": True})
    same = client.completions.create(model="tiny", prompt="<user>abc<assistant>de", max_tokens=4, temperature=0)
    assert r.choices[0].message.content == "de" + same.choices[0].text
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": convo, "continue_final_message": True})
    assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]


def test_chat_without_max_tokens_takes_the_rest_of_the_context(served):
    _, _, client = served
    r = client.chat.completions.create(model="tiny", messages=MSG, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 96 and r.choices[0].finish_reason == "length"


def test_prompt_logprobs_and_truncated_prompts(served):
    _, _, client = served
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2, "truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 5
    for pos, tok in zip(plp[1:], "world"[1:]):
        assert 2 <= len(pos) <= 3 and all(v["logprob"] <= 0 for v in pos.values())
        assert any(v["decoded_token"] == tok for v in pos.values())
    chat = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MSG, "stream": "yes"}),
    ("/v1/chat/completions", {"messages": MSG, "n": "2"}),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": 1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}),
    ("/v1/completions", {"prompt": "x", "echo": "true"}),
    ("/generate", {"text": "x", "stream": 0}),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2.0}}),
])
def test_strict_types(served, path, body):
    _, url, _ = served
    r = httpx.post(url + path, json=body)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_field", r.text


@pytest.mark.parametrize("body,words", [
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias keys"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "[-100, 100]"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "out of range"),
    ({"prompt": "x", "allowed_token_ids": []}, "must not be empty"),
    ({"prompt": "x", "allowed_token_ids": [-1]}, "out of range"),
    ({"prompt": "x", "bad_words": [""]}, "non-empty"),
])
def test_bad_values_are_400(served, body, words):
    _, url, _ = served
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_tokenize_detokenize_and_version(served):
    engine, url, _ = served
    for path in ("/tokenize", "/v1/tokenize"):
        r = httpx.post(url + path, json={"prompt": "hello", "return_token_strs": True}).json()
        assert r["tokens"] == ids_of(engine, "hello") and r["count"] == 5 and r["max_model_len"] == 96
        assert r["token_strs"] == list("hello")
    batch = httpx.post(url + "/v1/tokenize", json={"prompt": ["ab", "c"]}).json()
    assert batch["tokens"] == [ids_of(engine, "ab"), ids_of(engine, "c")] and batch["count"] == 3
    for path in ("/detokenize", "/v1/detokenize"):
        assert httpx.post(url + path, json={"tokens": ids_of(engine, "hey")}).json()["prompt"] == "hey"
    assert httpx.post(url + "/v1/detokenize", json={"tokens": [ids_of(engine, "a"), ids_of(engine, "b")]}).json() == \
        {"prompt": ["a", "b"], "text": ["a", "b"]}
    assert httpx.post(url + "/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert httpx.post(url + "/tokenize", json={}).status_code == 400
    assert httpx.get(url + "/version").json()["version"]
