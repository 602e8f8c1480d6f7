"""Bad input gets a clear error, and the server keeps serving with every slot accounted for."""

import asyncio

import pytest

from tests.server.conftest import accounting, assert_idle, make_engine, run, serving


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt, context_length=64)


CASES = [
    # (path, body or raw bytes, status, substring of the message)
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', 400, "malformed JSON"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 422, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": [1]}, 422, "temperature"),
    ("/v1/completions", {"max_tokens": 3}, 422, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    # an error names the field the client sent (OpenAI's max_tokens, vLLM's min_tokens), not the engine's
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens must be >= 0, got -1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -2}, 400,
     "max_tokens must be >= 0, got -2"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}, 400,
     "max_completion_tokens must be >= 0, got -3"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 60}, 400,
     "+ max_completion_tokens (60) exceeds the context length 64"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 5}, 400,
     "min_tokens must be in [0, max_tokens=3], got 5"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens must be >= 0"),
    ("/generate", {"text": "y" * 30, "sampling_params": {"max_new_tokens": 50}}, 400,
     "+ max_new_tokens (50) exceeds the context length"),
    ("/generate", {"text": "x", "sampling_params": {"sampling_seed": -1}}, 400, "sampling_seed must be in"),
    ("/v1/completions", {"prompt": "y" * 80}, 400, "context length"),
    ("/v1/completions", {"prompt": "y" * 30, "max_tokens": 50}, 400, "exceeds the context length"),
    ("/v1/completions", {"prompt": [7], "max_tokens": 64}, 400, "prompt (1 token) + max_tokens (64) exceeds"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": ["x", "y"], "session_id": "s"}, 400, "single prompt"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "1000 answers asked for in one request (prompts x n)"),
    ("/generate", {"text": ["a", "b"], "rid": "r"}, 400, "rid take a single prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/generate", {"text": "x", "input_ids": [1]}, 400, "exactly one"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, "exactly one"),
    ("/generate", {"input_ids": [1, 5000]}, 400, "out of range"),
    ("/generate", {"text": "x", "sampling_params": {"stop": [""]}}, 400, "non-empty"),
    ("/generate", {"text": "x", "sampling_params": "hot"}, 422, "sampling_params"),
    # values that passed validation and then failed the whole batch inside the scheduler
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature must be a finite number"),
    ("/generate", b'{"text": "x", "sampling_params": {"top_p": Infinity}}', 400, "top_p must be a finite"),
    ("/generate", {"text": "x", "sampling_params": {"seed": 2**64}}, 400, "seed must be in"),
    # values valid as Python floats that the sampler's float32 tensors cannot hold (0, infinity)
    ("/generate", {"text": "x", "sampling_params": {"top_p": 1e-46}}, 400, "it is 0 as a 32-bit float"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e-39}, 400, "repetition_penalty must be in [0.01, 2]"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e39}, 400, "temperature must be a finite 32-bit float"),
    ("/generate", {"input_ids": [False]}, 422, "input_ids"),
    ("/generate", b'{"text": "\\ud800"}', 400, "not well-formed unicode"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', 400, "well-formed"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', 400, "well-formed"),
    ("/open_session", b'{"timeout": NaN}', 400, "timeout"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs: true"),
    # the body as a whole: said in words, not as pydantic's "body: Field required"
    ("/v1/completions", b'', 422, "the request needs a JSON body"),
    ("/v1/completions", b'[1, 2]', 422, "the request body must be a JSON object"),
    ("/generate", b'"text"', 422, "the request body must be a JSON object"),
    ("/open_session", {"timeout": 1e300}, 400, "timeout must be in"),
]


def test_bad_requests_get_clear_errors_and_nothing_leaks(engine):
    async def go():
        async with serving(engine) as c:
            results = []
            for path, body, status, needle in CASES:
                if isinstance(body, bytes):
                    r = await c.post(path, content=body, headers={"content-type": "application/json"})
                else:
                    r = await c.post(path, json=body)
                results.append((path, body, status, needle, r))
            ok = await c.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 3})
            return results, ok, await accounting(engine), (await c.get("/metrics")).text

    results, ok, acc, metrics = run(go())
    for path, body, status, needle, r in results:
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert needle in err["message"], (path, body, err)
        assert err["type"] == "invalid_request_error" and err["code"]
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert_idle(acc)
    assert 'mambaserve_requests_rejected_total{reason="too_long"} 5.0' in metrics


def test_unknown_routes_and_methods(engine):
    async def go():
        async with serving(engine) as c:
            return await c.get("/v1/nothing"), await c.get("/v1/completions")

    missing, wrong_method = run(go())
    assert missing.status_code == 404 and wrong_method.status_code == 405


def test_validation_messages_are_sentences_not_pydantic_internals(engine):
    """A validator's own sentence comes as it is written (no "body: Value error, " before it)."""
    async def go():
        async with serving(engine) as c:
            return [await c.post("/generate", content=body, headers={"content-type": "application/json"})
                    for body in (b'{"text": "\\ud800"}', b'{"text": ["ok", "\\ud800"]}')]

    for r in run(go()):  # a lone surrogate alone, and one in a list
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "text is not well-formed unicode (a lone surrogate?)"


def test_json_bodies_are_read_whatever_the_content_type_says(engine):
    """``curl -d`` sends application/x-www-form-urlencoded and some clients send no type: the body is
    JSON all the same; a body that is not JSON gets the JSON error, not a nameless 422."""
    body = b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}'

    async def go():
        async with serving(engine) as c:
            sent = [await c.post("/generate", content=body, headers={"content-type": ct} if ct else {})
                    for ct in (None, "application/x-www-form-urlencoded", "text/plain; charset=utf-8")]
            form = await c.post("/generate", content=b"text=hi",
                                headers={"content-type": "application/x-www-form-urlencoded"})
            return sent, form

    sent, form = run(go())
    assert [r.status_code for r in sent] == [200] * 3 and all(r.json()["output_ids"] for r in sent)
    assert form.status_code == 400 and form.json()["error"]["code"] == "invalid_json"


def test_one_requests_bad_values_or_duplicate_id_hurt_no_other(engine):
    """Bad values sent alongside good requests fail alone; a duplicate request id is a 409 while the
    first request with that id runs on to its normal end."""
    async def go():
        async with serving(engine) as c:
            good = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 20, "temperature": 0.7,
                                                                "ignore_eos": True}}
            # long enough to still run when the duplicate arrives, which is sent once it holds a slot
            first = asyncio.ensure_future(c.post("/generate", json={**good, "rid": "dup", "sampling_params": {
                **good["sampling_params"], "max_new_tokens": 55}}))
            while not first.done() and (await engine.accounting())["held_by_requests"] == 0:
                await asyncio.sleep(0.005)
            bad = [c.post("/generate", content=b'{"input_ids": [3], "sampling_params": {"temperature": NaN}}',
                          headers={"content-type": "application/json"}),
                   c.post("/generate", json={**good, "rid": "dup"})]
            rest = await asyncio.gather(*bad, *(c.post("/generate", json=good) for _ in range(3)))
            return await first, rest, await accounting(engine)

    first, (nan, dup, *others), acc = run(go())
    assert nan.status_code == 400
    assert dup.status_code == 409 and dup.json()["error"]["code"] == "duplicate_request_id", dup.text
    for r in [first, *others]:
        assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length", r.text
    assert_idle(acc)


def test_bounded_resources_body_size_queue_and_prompt_count(tiny_ckpt):
    """Bodies over --max-request-bytes get 413 before parsing (declared or chunked); past
    running + --max-queued-requests a request gets 503 with Retry-After; too many prompts in one
    request get 400. The server keeps serving and nothing leaks."""
    engine = make_engine(tiny_ckpt, max_request_bytes=4096, max_queued_requests=1, max_running_requests=1)
    long = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}}

    async def chunks():
        for _ in range(8):
            yield b"x" * 1024

    async def go():
        async with serving(engine) as c:
            declared = await c.post("/generate", json={"text": "y" * 5000})
            chunked = await c.post("/generate", content=chunks(), headers={"content-type": "application/json"})
            many = await c.post("/v1/completions", json={"prompt": [[1, 2]] * 65, "max_tokens": 1})
            burst = await asyncio.gather(*(c.post("/generate", json=long) for _ in range(4)))
            ok = await c.post("/generate", json={"text": "still serving", "sampling_params": {"max_new_tokens": 2}})
            return declared, chunked, many, burst, ok, await accounting(engine), (await c.get("/metrics")).text

    declared, chunked, many, burst, ok, acc, metrics = run(go())
    for r in (declared, chunked):
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert many.status_code == 400 and "at most 64" in many.json()["error"]["message"]
    codes = sorted(r.status_code for r in burst)
    assert codes == [200, 200, 503, 503], codes
    refused = next(r for r in burst if r.status_code == 503)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "overloaded"
    assert ok.status_code == 200
    assert 'mambaserve_requests_rejected_total{reason="overloaded"} 2.0' in metrics
    assert 'mambaserve_requests_rejected_total{reason="too_large"} 2.0' in metrics
    assert_idle(acc)


def test_snapshot_names_ownership_and_quotas(tiny_ckpt, tmp_path):
    engine = make_engine(tiny_ckpt, session_snapshot_dir=str(tmp_path), session_snapshot_max_per_session=2)

    async def go():
        async with serving(engine) as c:
            a = (await c.post("/open_session", json={"streaming": True})).json()
            b = (await c.post("/open_session", json={"streaming": True})).json()
            await c.post("/generate", json={"input_ids": [3, 4], "session_params": {"id": a},
                                            "sampling_params": {"max_new_tokens": 2}})
            snap = lambda sid, name: c.post(f"/sessions/{sid}/snapshot", json={"name": name})  # noqa: E731
            bad = [await snap(a, name) for name in ("a\u0000b", "x" * 200, ".hidden", "../up", "a/b")]
            mine = await snap(a, "one")
            again = await snap(a, "one")  # its own file: overwritten
            taken = await snap(b, "one")  # another session's file: never
            second = await snap(a, "two")
            over = await snap(a, "three")
            restored = await c.post("/sessions/restore", json={"name": "one", "session_id": "copy"})
            return bad, mine, again, taken, second, over, restored, await accounting(engine)

    bad, mine, again, taken, second, over, restored, acc = run(go())
    for r in bad:
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
        assert "\x00" not in r.text
    assert mine.status_code == again.status_code == second.status_code == 200
    assert "path" not in mine.json() and str(tmp_path) not in mine.text
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "snapshot_exists"
    assert over.status_code == 429 and over.json()["error"]["code"] == "snapshot_quota"
    assert restored.status_code == 200 and restored.json()["has_state"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]
    assert acc["running"] == 0


def test_api_key_guards_everything_but_health_and_metrics(tiny_ckpt, tmp_path):
    engine = make_engine(tiny_ckpt, api_key="s3cret")
    gen = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}

    async def go():
        async with serving(engine) as c:
            ok = {"Authorization": "Bearer s3cret"}
            open_ = [(await c.get(p)).status_code for p in ("/health", "/metrics")]
            denied = [await c.post("/generate", json=gen), await c.post("/flush_cache"),
                      await c.post("/abort_request", json={"rid": "x"}), await c.post("/open_session", json={}),
                      await c.get("/v1/models"), await c.get("/get_server_info"),
                      await c.post("/generate", json=gen, headers={"Authorization": "Bearer wrong"}),
                      await c.post("/generate", json=gen, headers={"Authorization": "s3cret"})]
            allowed = [await c.post("/generate", json=gen, headers=ok), await c.get("/v1/models", headers=ok)]
            return open_, denied, allowed, (await c.get("/metrics")).text

    open_, denied, allowed, metrics = run(go())
    assert open_ == [200, 200]
    for r in denied:
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert r.headers["www-authenticate"] == "Bearer"
    assert [r.status_code for r in allowed] == [200, 200]
    assert 'mambaserve_requests_rejected_total{reason="unauthorized"} 8.0' in metrics

    from mambaserve.server.cli import api_keys

    (tmp_path / "key").write_text("from-file\n")
    assert api_keys(None, str(tmp_path / "key"), "from-env") == ("from-file",)
    (tmp_path / "keys").write_text("one\n\n two \none\n")  # one client per key, blank lines and repeats dropped
    assert api_keys(None, str(tmp_path / "keys"), None) == ("one", "two")
    assert api_keys("from-flag", None, "from-env") == ("from-flag",)
    assert api_keys(None, None, "from-env") == ("from-env",)
    assert api_keys(None, None, None) == ()
    with pytest.raises(SystemExit, match="empty"):
        api_keys(None, None, "  ")
    with pytest.raises(SystemExit, match="cannot read"):
        api_keys(None, str(tmp_path / "missing"), None)
    assert "s3cret" not in repr(engine.cfg)


def test_request_timeout_ends_a_long_request_and_frees_its_slot(tiny_ckpt):
    # (1.5 s: the first steps of a fresh engine on a loaded 2-core machine took longer than 0.5 s once, no token came)
    engine = make_engine(tiny_ckpt, request_timeout=1.5, context_length=8192)
    long = {"max_new_tokens": 8000, "temperature": 0, "ignore_eos": True}

    async def go():
        async with serving(engine) as c:
            await c.post("/generate", json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})  # warm
            native = await c.post("/generate", json={"input_ids": [3, 4], "sampling_params": long})
            openai = await c.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 8000, "ignore_eos": True})
            quick = await c.post("/generate", json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})
            return native, openai, quick, await accounting(engine)

    native, openai, quick, acc = run(go())
    info = native.json()["meta_info"]
    assert info["finish_reason"]["type"] == "abort" and "timeout" in info["finish_reason"]["message"]
    assert 0 < info["completion_tokens"] < 8000
    assert openai.status_code == 504 and openai.json()["error"]["code"] == "request_timeout"
    assert quick.status_code == 200
    assert_idle(acc)


def test_a_huge_prompt_does_not_stall_the_event_loop(tiny_ckpt):
    """Tokenizing a multi-megabyte prompt runs off the event loop: /health answers while it runs (the
    prompt is then refused for its length)."""
    engine = make_engine(tiny_ckpt)
    text = "def f(x):\n    return x  # " * 100_000  # 2.7 MB: seconds of tokenizing

    async def go():
        async with serving(engine) as c:
            done = []

            async def big():
                r = await c.post("/generate", json={"text": text})
                done.append("big")
                return r

            task = asyncio.ensure_future(big())
            await asyncio.sleep(0.3)  # the body is in and tokenizing
            health = await c.get("/health")
            done.append("health")
            return await task, health, done

    big, health, done = run(go())
    assert health.status_code == 200
    assert done == ["health", "big"], done
    assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded"


def test_models_retrieve_router_default_name_and_absolute_paths(tiny_ckpt):
    """The OpenAI SDK's models.retrieve, sglang-router's "unknown" model, and info paths a router started
    elsewhere can use as they are."""
    engine = make_engine(tiny_ckpt)

    async def go():
        async with serving(engine) as c:
            return (await c.get("/v1/models/tiny"), await c.get("/v1/models/gpt-9"),
                    await c.post("/v1/completions", json={"model": "unknown", "prompt": "x", "max_tokens": 1}),
                    (await c.get("/get_model_info")).json(), (await c.get("/get_server_info")).json(),
                    await c.get("/no/such/route"), await c.delete("/generate"),
                    await c.post("/v1/chat/completions", json={"model": str(tiny_ckpt.resolve()), "max_tokens": 1,
                                                               "messages": [{"role": "user", "content": "x"}]}))

    card, missing, unknown, info, server, route, method, by_path = run(go())
    assert by_path.status_code == 200, by_path.text
    assert card.status_code == 200 and card.json()["id"] == "tiny"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert unknown.status_code == 200
    assert info["model_path"] == str(tiny_ckpt.resolve()) and info["tokenizer_path"].startswith("/")
    assert server["model_path"] == str(tiny_ckpt.resolve())
    assert route.status_code == 404 and route.json()["error"]["code"] == "not_found"
    assert method.status_code == 405 and method.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("flags,needle", [(["--port", "99999"], "--port"), (["--context-length", "-5"], "context-length"),
                                          (["--session-timeout", "nan"], "session-timeout")])
def test_bad_flags_exit_with_one_line_before_loading(flags, needle, tiny_ckpt):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mambaserve.server", "serve", "--model", str(tiny_ckpt), *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and needle in done.stderr and "Traceback" not in done.stderr, done.stderr
