"""Bad input gets a clear error, and the server keeps serving with every slot accounted for."""

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
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_new_tokens must be >= 0"),
    ("/v1/completions", {"prompt": "y" * 80}, 400, "context length"),
    ("/v1/completions", {"prompt": "y" * 30, "max_tokens": 50}, 400, "exceeds the context length"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 3}, 400, "n=1"),
    ("/v1/chat/completions", {"messages": []}, 422, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 422, "role"),
    ("/generate", {"text": "x", "input_ids": [1]}, 400, "exactly one"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, "exactly one"),
    ("/generate", {"input_ids": [1, 5000]}, 400, "out of range"),
    ("/generate", {"text": "x", "sampling_params": {"stop": [""]}}, 400, "non-empty"),
    ("/generate", {"text": "x", "sampling_params": "hot"}, 422, "sampling_params"),
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
    assert 'mambaserve_requests_rejected_total{reason="too_long"} 2.0' in metrics


def test_unknown_routes_and_methods(engine):
    async def go():
        async with serving(engine) as c:
            return await c.get("/v1/nothing"), await c.get("/v1/completions")

    missing, wrong_method = run(go())
    assert missing.status_code == 404 and wrong_method.status_code == 405
