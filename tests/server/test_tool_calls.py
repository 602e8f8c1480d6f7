"""Tool calls through the official OpenAI client: ``tools`` rendered by the model's own template (or a system
message of the server's where the template reads none), ``tool_choice`` none / auto / required / named,
``parallel_tool_calls``, answers parsed into ``tool_calls`` and streamed as deltas, in the JSON / Hermes
(Granite 4.0) and Nemotron-H formats. The bundled model never saw a tool call: the grammar of required and
named choices is what makes its calls parse."""

import json
import shutil
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from mambaserve.server.api import tool_calls  # noqa: E402
from tests.server.conftest import accounting, assert_idle, make_engine, run, uvicorn_server  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "models" / "mamba2-tiny-pystdlib"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"type": "integer", "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
# templates written for these tests in the two families' formats: Granite 4.0's lists the tools in <tools> and
# asks for <tool_call> blocks; Nemotron-H's (Nano) lists them in <AVAILABLE_TOOLS> and asks for <TOOLCALL>[...]
GRANITE_LIKE = (
    "{% if tools %}<|system|>\nYou can call these tools:\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools>\nFor each call, answer with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|endoftext|>\n"
    "{% endif %}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% endif %}<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
NEMOTRON_LIKE = (
    "{% if tools %}<|system|>\n<AVAILABLE_TOOLS>{{ tools | tojson }}</AVAILABLE_TOOLS>\nCall tools as "
    "<TOOLCALL>[{\"name\": ..., \"arguments\": ...}]</TOOLCALL><|endoftext|>\n{% endif %}{% for m in messages %}"
    "<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _model(tmp, template):
    path = tmp / "model"
    shutil.copytree(MODEL, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module", params=["bundled", "granite", "nemotron"])
def served(request, tmp_path_factory):
    template = {"bundled": None, "granite": GRANITE_LIKE, "nemotron": NEMOTRON_LIKE}[request.param]
    path = MODEL if template is None else _model(tmp_path_factory.mktemp(request.param), template)
    engine = make_engine(path, context_length=2048, max_running_requests=8, mamba_cache_size=16)
    with uvicorn_server(engine) as url:
        yield request.param, url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert_idle(run(accounting(engine)))


def _check(calls, names=SCHEMAS):
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_tools_reach_the_prompt_in_the_templates_format(served):
    family, url, _ = served
    ids = httpx.post(url + "/tokenize", json={"messages": MSG, "tools": TOOLS}).json()["tokens"]
    prompt = httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "get_weather" in prompt and '"maxLength": 12' in prompt
    assert {"bundled": "<tool_call>", "granite": "<tools>", "nemotron": "<AVAILABLE_TOOLS>"}[family] in prompt


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_parse_and_stream_as_deltas(served, parallel):
    family, _, client = served
    kw = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
              temperature=0.8, seed=5, max_tokens=400)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert len(choice.message.tool_calls) >= 1 and (parallel or len(choice.message.tool_calls) == 1)
    _check(choice.message.tool_calls)
    if choice.finish_reason == "length":  # (a model never trained to stop may go on calling: the last is cut)
        assert parallel and choice.message.content.startswith("<tool_call>\n"), choice
    else:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    streamed, content = {}, ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                streamed[d.index] = (d.function.name, d.function.arguments)
            finish = ch.finish_reason or None
    assert content == (choice.message.content or "") and finish == choice.finish_reason
    assert streamed == {i: (c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls)}


def test_a_named_function_under_n(served):
    _, _, client = served
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, n=2, temperature=1.0, seed=3,
                                       tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=300)
    for choice in r.choices:
        assert [c.function.name for c in choice.message.tool_calls] == ["add"]
        _check(choice.message.tool_calls, {"add"})


def test_auto_parses_what_the_model_writes_and_none_does_not(served):
    family, _, client = served
    fmt = tool_calls.NEMOTRON if family == "nemotron" else tool_calls.HERMES
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    written = f"Sure. {fmt.start}[{call}]{fmt.end}" if fmt.listed else f"Sure. {fmt.start}\n{call}\n{fmt.end}"
    # a grammar makes the model write exactly that text: what a tool-trained model would write itself
    force = {"structured_outputs": {"choice": [written]}}
    auto = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, max_tokens=100, extra_body=force)
    assert auto.choices[0].message.content == "Sure." and auto.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in auto.choices[0].message.tool_calls] == \
        [("add", {"a": 1, "b": 2})]
    none = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="none", max_tokens=100,
                                          extra_body=force)
    assert none.choices[0].message.content == written and not none.choices[0].message.tool_calls


def test_tool_conversations_render_and_bad_choices_are_400(served):
    _, url, client = served
    history = MSG + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    for body in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
                 {"tool_choice": "required"},
                 {"tool_choice": "required", "tools": TOOLS, "response_format": {"type": "json_object"}},
                 {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **body})
        assert r.status_code in (400, 422), (body, r.text)


def test_parser_streams_what_it_parses_whole():
    text = 'Hi <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": ' \
           '"add", "arguments": {"a": 3, "b": 4}}\n</tool_call><tool_call>not json</tool_call> <tool'
    whole = tool_calls.ToolCallParser(tool_calls.HERMES, TOOLS)
    content, calls = whole.feed(text)
    content += whole.finish()
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert content == "Hi<tool_call>not json</tool_call> <tool"
    parts = tool_calls.ToolCallParser(tool_calls.HERMES, TOOLS)
    pieces = [parts.feed(ch) for ch in text]
    assert "".join(p[0] for p in pieces) + parts.finish() == content
    assert [c["function"] for p in pieces for c in p[1]] == [c["function"] for c in calls]
    one = tool_calls.ToolCallParser(tool_calls.HERMES, TOOLS, parallel=False)
    assert len(one.feed(text)[1]) == 1
    listed = tool_calls.ToolCallParser(tool_calls.NEMOTRON, TOOLS)
    _, calls = listed.feed('<TOOLCALL>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                           '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}]</TOOLCALL>')
    assert [c["function"]["name"] for c in calls] == ["add", "get_weather"]
