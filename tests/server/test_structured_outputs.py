"""Structured outputs through the official OpenAI client and SGLang's /generate, on the bundled model (which
writes Python, never JSON: every valid answer below is the grammar's doing), and on a tiny hybrid."""

import json
import re
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from mambaserve.server.engine.request import BadRequest, SamplingParams  # noqa: E402
from tests.server.conftest import accounting, assert_idle, make_engine, run, run_started, uvicorn_server  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "models" / "mamba2-tiny-pystdlib"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
}, "required": ["name", "age", "role", "tags"], "additionalProperties": False}
MSG = [{"role": "user", "content": "Describe a user as JSON."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def served():
    engine = make_engine(MODEL, context_length=1024, max_running_requests=8, mamba_cache_size=16)
    with uvicorn_server(engine) as url:
        yield engine, url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert_idle(run(accounting(engine)))


def test_json_schema_answers_validate_under_n_and_in_streams(served):
    _, _, client = served
    r = client.chat.completions.create(model="tiny", messages=MSG, n=3, temperature=1.0, seed=7, max_tokens=120,
                                       response_format=FORMAT)
    assert len({c.message.content for c in r.choices}) > 1  # sampled: distinct answers, each valid
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)
    texts = {}
    for chunk in client.chat.completions.create(model="tiny", messages=MSG, n=2, temperature=1.0, seed=7,
                                                max_tokens=120, response_format=FORMAT, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert texts == {0: r.choices[0].message.content, 1: r.choices[1].message.content}  # (seed + i per answer)


def test_json_object_regex_choice_and_grammar(served):
    _, _, client = served
    r = client.chat.completions.create(model="tiny", messages=MSG, temperature=0, max_tokens=200,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    cases = [({"regex": r"[0-9]{3}-[a-z]{2,5}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
             ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
             ({"grammar": 'root ::= "def " [a-z]+ "():"'}, lambda t: re.fullmatch(r"def [a-z]+\(\):", t)),
             ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None)]
    for so, ok in cases:
        r = client.completions.create(model="tiny", prompt="import os\n", temperature=0.7, seed=3, max_tokens=80,
                                      extra_body={"structured_outputs": so})
        assert r.choices[0].finish_reason == "stop" and ok(r.choices[0].text), (so, r.choices[0].text)
    # vLLM's older names and SGLang's OpenAI extras
    for extra in ({"guided_choice": ["red", "blue"]}, {"regex": "(red|blue)"}, {"ebnf": 'root ::= "red" | "blue"'}):
        r = client.completions.create(model="tiny", prompt="x = ", max_tokens=10, extra_body=extra)
        assert r.choices[0].text in ("red", "blue"), extra


def test_sglang_native_constraints(served):
    _, url, _ = served
    for sp, ok in (({"json_schema": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
                   ({"regex": "[A-Z][a-z]{1,6}"}, lambda t: re.fullmatch("[A-Z][a-z]{1,6}", t)),
                   ({"ebnf": 'root ::= "a" | "b"'}, lambda t: t in "ab")):
        r = httpx.post(f"{url}/generate", json={"text": "def f():", "sampling_params": {
            "max_new_tokens": 100, "temperature": 0.8, "n": 2, **sp}}, timeout=60)
        assert r.status_code == 200, r.text
        for answer in r.json():
            assert answer["meta_info"]["finish_reason"]["type"] == "stop" and ok(answer["text"]), answer["text"]


def test_bad_grammars_and_conflicts_are_400(served):
    _, url, _ = served
    bad = [{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
           {"structured_outputs": {"regex": "(unclosed"}},
           {"structured_outputs": {"regex": "a", "choice": ["b"]}},
           {"structured_outputs": {"choice": []}},
           {"response_format": {"type": "json_object"}, "regex": "a+"},
           {"response_format": {"type": "json_object"}, "min_tokens": 3},
           {"response_format": {"type": "json_schema"}}]
    for extra in bad:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, **extra}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
    r = httpx.post(f"{url}/generate", json={"text": "x", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}})
    assert r.status_code == 400 and "at most one" in r.json()["error"]["message"]


def test_strict_schemas_take_no_unnamed_property(served):
    _, _, client = served
    open_schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": open_schema, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=MSG, temperature=1.0, seed=seed, max_tokens=60,
                                           response_format=fmt)
        assert set(json.loads(r.choices[0].message.content)) == {"ok"}


def test_compiled_grammars_are_cached_by_source(served):
    engine, _, _ = served
    a = engine.grammars.compile("json_schema", json.dumps(PERSON))
    assert engine.grammars.compile("json_schema", json.dumps(PERSON)) is a
    assert engine.grammars.compile("regex", "a+") is not a
    with pytest.raises(BadRequest, match="invalid regex"):
        engine.grammars.compile("regex", "(")


@pytest.mark.parametrize("overlap", [True, False])
def test_same_answers_with_and_without_overlap_on_a_hybrid(nemotron, overlap):
    """The tiny Nemotron-H (a byte-level vocabulary llguidance reads token by token) under both schedulers."""
    engine = make_engine(nemotron, disable_overlap_schedule=not overlap)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}

    async def go():
        outs = []
        for constraint in (("json_schema", json.dumps(schema)), ("regex", "[a-c]{4}"), ("choice", '["on", "off"]')):
            gens = engine.generate_n(engine.encode("hello"), SamplingParams(max_new_tokens=40, temperature=0.9, seed=1,
                                                                            constraint=constraint), 2)
            for g in gens:
                text = "".join([o.text async for o in g])
                outs.append(text)
        return outs

    outs = run_started(engine, go)
    assert all(jsonschema.validate(json.loads(t), schema) is None for t in outs[:2])
    assert all(re.fullmatch("[a-c]{4}", t) for t in outs[2:4]) and set(outs[4:]) <= {"on", "off"}
    key = "overlap" if overlap else "plain"
    _SEEN[key] = outs
    if len(_SEEN) == 2:
        assert _SEEN["overlap"] == _SEEN["plain"]


_SEEN: dict[str, list[str]] = {}
