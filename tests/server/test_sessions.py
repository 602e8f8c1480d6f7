"""Streaming and non-streaming sessions through the HTTP API, checked against history-resending runs."""

import asyncio
import os
import subprocess
import sys

import httpx
import pytest

from tests.server.conftest import accounting, assert_idle, free_port, make_engine, run, serving, wait_healthy

GREEDY = {"temperature": 0, "ignore_eos": True}


def _words(n, seed):
    return [(seed * 13 + 5 * k * k + 3 * k) % 94 + 1 for k in range(n)]


async def _turn(c, ids, sid=None, n=5, **sp):
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": n, **GREEDY}}
    if sid:
        body["session_params"] = {"id": sid, **sp}
    r = await c.post("/generate", json=body)
    return r


def _unpack(r):
    assert r.status_code == 200, r.text
    b = r.json()
    return b["output_ids"], [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]], b["meta_info"]["cached_tokens"]


@pytest.fixture(scope="module")
def cold(tiny_ckpt):
    return make_engine(tiny_ckpt, disable_radix_cache=True, context_length=4096)


def test_streaming_session_ten_turns_equal_resent_history(tiny_ckpt, cold):
    engine = make_engine(tiny_ckpt, context_length=4096)
    turns = [_words(3 + (i * 5) % 11, i) for i in range(10)]

    async def with_session():
        async with serving(engine) as c:
            sid = (await c.post("/open_session", json={"capacity_of_str_len": 4096, "streaming": True})).json()
            out = [_unpack(await _turn(c, t, sid)) for t in turns]
            await c.post("/close_session", json={"session_id": sid})
            return out, await accounting(engine), (await c.get("/metrics")).text

    async def resent():
        async with serving(cold) as c:
            history, out = [], []
            for t in turns:
                history += t
                ids, lps, cached = _unpack(await _turn(c, history))
                history += ids
                out.append((ids, lps, cached))
            return out

    got, acc, metrics = run(with_session())
    ref = run(resent())
    before = 0
    for (ids, lps, cached), (rids, rlps, _), t in zip(got, ref, turns):
        assert ids == rids
        assert lps == pytest.approx(rlps, abs=1e-5)
        assert cached == before  # every token before this turn came from the session's live state
        before += len(t) + len(ids)
    assert_idle(acc)
    assert acc["held_by_sessions"] == 0 and acc["sessions"] == 0
    assert 'mambaserve_prefix_cache_hit_tokens_total{tier="session"}' in metrics
    assert 'mambaserve_sessions_closed_total{reason="client"} 1.0' in metrics


def test_concurrent_streaming_sessions_with_ordinary_traffic(tiny_ckpt, cold):
    engine = make_engine(tiny_ckpt, context_length=4096, chunked_prefill_size=7, mamba_cache_size=16,
                         max_running_requests=8)

    async def session_run(c, k):
        sid = (await c.post("/open_session", json={"streaming": True})).json()
        outs = []
        for i in range(5):
            outs.append(_unpack(await _turn(c, _words(4 + (i + k) % 9, 10 * k + i), sid, n=4)))
        await c.post("/close_session", json={"session_id": sid})
        return outs

    async def go():
        async with serving(engine) as c:
            noise = [_turn(c, _words(15 + i, 99 + i), n=3) for i in range(6)]
            results = await asyncio.gather(*[session_run(c, k) for k in range(6)], *noise)
            return results[:6], await accounting(engine)

    async def reference():
        async with serving(cold) as c:
            refs = []
            for k in range(6):
                history, outs = [], []
                for i in range(5):
                    history += _words(4 + (i + k) % 9, 10 * k + i)
                    ids, lps, _ = _unpack(await _turn(c, history, n=4))
                    history += ids
                    outs.append((ids, lps))
                refs.append(outs)
            return refs

    got, acc = run(go())
    ref = run(reference())
    for g, r in zip(got, ref):
        for (ids, lps, _), (rids, rlps) in zip(g, r):
            assert ids == rids and lps == pytest.approx(rlps, abs=1e-5)
    assert_idle(acc)
    assert acc["sessions"] == 0


def test_aborted_turns_keep_history_and_the_session_recovers(tiny_ckpt, cold):
    engine = make_engine(tiny_ckpt, context_length=8192)
    t1, t2, t3 = _words(6, 1), _words(5, 2), _words(4, 3)

    async def abort_turn(c, sid, ids, rid):
        task = asyncio.ensure_future(c.post("/generate", json={
            "input_ids": ids, "rid": rid, "session_params": {"id": sid},
            "sampling_params": {"max_new_tokens": 6000, **GREEDY}}))
        while (await c.get("/get_server_info")).json()["internal_states"][0]["running"] == 0:
            await asyncio.sleep(0.01)
        await c.post("/abort_request", json={"rid": rid})
        return (await task).json()["meta_info"]["finish_reason"]["type"]

    async def go():
        async with serving(engine) as c:
            sid = (await c.post("/open_session", json={"streaming": True})).json()
            first = await abort_turn(c, sid, t1, "a1")  # abort in turn 1
            o1 = _unpack(await _turn(c, t1, sid))
            o2 = _unpack(await _turn(c, t2, sid))
            nth = await abort_turn(c, sid, t3, "a3")  # abort in turn n
            o3 = _unpack(await _turn(c, t3, sid))
            await c.post("/close_session", json={"session_id": sid})
            return first, nth, o1, o2, o3, await accounting(engine)

    async def reference():
        async with serving(cold) as c:
            r1 = _unpack(await _turn(c, t1))
            r2 = _unpack(await _turn(c, t1 + r1[0] + t2))
            r3 = _unpack(await _turn(c, t1 + r1[0] + t2 + r2[0] + t3))
            return r1, r2, r3

    first, nth, o1, o2, o3, acc = run(go())
    r1, r2, r3 = run(reference())
    assert first == nth == "abort"
    assert (o1[0], o2[0], o3[0]) == (r1[0], r2[0], r3[0])
    assert o3[1] == pytest.approx(r3[1], abs=1e-5)
    assert o2[2] == len(t1) + len(o1[0])  # the turn after an abort is back on the live state
    assert_idle(acc)


def test_session_rules_and_limits(tiny_ckpt):
    engine = make_engine(tiny_ckpt, max_sessions=2, context_length=8192)

    async def go():
        r = {}
        async with serving(engine) as c:
            a = (await c.post("/open_session", json={"session_id": "a", "streaming": True})).json()
            r["dup"] = await c.post("/open_session", json={"session_id": "a"})
            b = (await c.post("/open_session", json={"streaming": False})).json()
            r["full"] = await c.post("/open_session", json={})
            r["unknown"] = await _turn(c, [1, 2], "nope")
            r["close_unknown"] = await c.post("/close_session", json={"session_id": "nope"})
            await _turn(c, [5, 6, 7], a)
            r["replace"] = await _turn(c, [1], a, replace=True)
            r["offset"] = await _turn(c, [1], a, offset=2)
            r["drop"] = await _turn(c, [1], a, drop_previous_output=True)
            r["rid"] = await _turn(c, [1], a, rid="someone-else")
            long = asyncio.ensure_future(_turn(c, [3, 4], a, n=6000))
            while (await c.get("/get_server_info")).json()["internal_states"][0]["running"] == 0:
                await asyncio.sleep(0.01)
            r["concurrent"] = await _turn(c, [9], a)
            r["deferred_close"] = await c.post("/close_session", json={"session_id": a})
            r["after_close"] = await _turn(c, [9], a)
            await c.post("/abort_request", json={"rid": (await _running_rid(engine))})
            r["long"] = await long
            r["empty"] = await _turn(c, [], b)
            r["ok_b"] = await _turn(c, [8, 9], b)
            await c.post("/close_session", json={"session_id": b})
            r["acc"] = await accounting(engine)
        return r

    r = run(go())
    assert r["dup"].status_code == 409
    assert r["full"].status_code == 429 and "too many open sessions" in r["full"].json()["error"]["message"]
    assert r["unknown"].status_code == 404 and r["close_unknown"].status_code == 404
    for k in ("replace", "offset", "drop", "rid"):
        assert r[k].status_code == 400 and "append-only" in r[k].json()["error"]["message"], k
    assert r["concurrent"].status_code == 409
    assert r["deferred_close"].status_code == 200
    assert r["after_close"].status_code == 404
    assert r["long"].status_code == 200 and r["long"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert r["empty"].status_code == 400
    assert r["ok_b"].status_code == 200
    assert r["acc"]["sessions"] == 0
    assert_idle(r["acc"])



@pytest.mark.parametrize("streaming", [True, False])
def test_a_session_capacity_caps_its_answers_too(tiny_ckpt, streaming):
    """capacity_of_str_len caps the session's tokens, answers included: a turn's max_new_tokens (explicit or
    the default) is cut to the room the capacity leaves after its prompt (finish_reason length), a turn
    whose prompt fills it answers nothing, and one past it is refused (400 session_full)."""
    engine = make_engine(tiny_ckpt, context_length=256)

    async def go():
        async with serving(engine) as c:
            sid = (await c.post("/open_session", json={"capacity_of_str_len": 12, "streaming": streaming})).json()
            first = await _turn(c, _words(4, 1), sid, n=100)
            body = {"input_ids": _words(3, 2), "session_params": {"id": sid}, "sampling_params": GREEDY}
            default = await c.post("/generate", json=body)  # no max_new_tokens: the server's default
            past = await _turn(c, [5], sid, n=3)
            full = (await c.post("/open_session", json={"capacity_of_str_len": 6, "streaming": streaming})).json()
            return first, default, past, await _turn(c, _words(6, 3), full, n=4), await accounting(engine)

    first, default, past, filled, acc = run(go())
    assert first.status_code == 200 and len(first.json()["output_ids"]) == 8  # 4 + 8 = 12
    assert first.json()["meta_info"]["finish_reason"]["type"] == "length"
    if streaming:  # append-only: the history is full
        assert default.status_code == 400 and default.json()["error"]["code"] == "session_full"
    else:  # branches from the last turn: 12 + 3 new tokens
        assert default.status_code == 400 and "15 tokens, over its capacity 12" in default.json()["error"]["message"]
    assert past.status_code == 400 and past.json()["error"]["code"] == "session_full"
    assert filled.status_code == 200 and filled.json()["output_ids"] == []
    assert filled.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert acc["running"] == 0

async def _running_rid(engine):
    return await engine.run_in_scheduler(lambda: engine.scheduler.queues.running[0].rid)


def test_idle_sessions_time_out(tiny_ckpt):
    engine = make_engine(tiny_ckpt)

    async def go():
        async with serving(engine) as c:
            sid = (await c.post("/open_session", json={"streaming": True, "timeout": 0.3})).json()
            await _turn(c, [4, 5, 6], sid)
            held = (await accounting(engine))["held_by_sessions"]
            await asyncio.sleep(1.5)
            gone = await _turn(c, [7], sid)
            return held, gone, await accounting(engine), (await c.get("/metrics")).text

    held, gone, acc, metrics = run(go())
    assert held == 1 and gone.status_code == 404
    assert acc["sessions"] == 0 and acc["held_by_sessions"] == 0
    assert 'mambaserve_sessions_closed_total{reason="timeout"} 1.0' in metrics


def test_non_streaming_session_branches_through_the_cache(tiny_ckpt, cold):
    engine = make_engine(tiny_ckpt, context_length=4096)
    q1, q2, q3 = _words(7, 4), _words(5, 5), _words(6, 6)

    async def go():
        async with serving(engine) as c:
            sid = (await c.post("/open_session", json={})).json()
            r1 = await c.post("/generate", json={"input_ids": q1, "rid": "t1", "session_params": {"id": sid},
                                                 "return_logprob": True,
                                                 "sampling_params": {"max_new_tokens": 4, **GREEDY}})
            r2 = _unpack(await _turn(c, q2, sid, n=4))  # continues t1
            r3 = _unpack(await _turn(c, q3, sid, n=4, rid="t1", drop_previous_output=True))  # q1 + q3
            r4 = _unpack(await _turn(c, q3, sid, n=4, rid="t1", offset=3))  # q1[:3] + q3
            return _unpack(r1), r2, r3, r4, await accounting(engine)

    async def reference(o1):
        async with serving(cold) as c:
            return [_unpack(await _turn(c, ids, n=4)) for ids in (q1 + o1 + q2, q1 + q3, q1[:3] + q3)]

    o1, o2, o3, o4, acc = run(go())
    ref = run(reference(o1[0]))
    assert [o2[0], o3[0], o4[0]] == [r[0] for r in ref]
    assert o2[2] == len(q1) + len(o1[0])  # served from the radix cache
    assert o3[2] == len(q1) - 1  # the state before q1's last token, kept when t1 was prefilled
    assert o4[2] == 0  # no snapshot at 3 tokens or fewer
    assert_idle(acc)


def test_openai_chat_with_session_header(tiny_ckpt):
    engine = make_engine(tiny_ckpt, context_length=4096)

    async def go():
        async with serving(engine) as c:
            sid = (await c.post("/open_session", json={"streaming": True})).json()
            h = {"x-session-id": sid}
            m = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
            a = await c.post("/v1/chat/completions", json=m, headers=h)
            b = await c.post("/v1/chat/completions", json={**m, "messages": [{"role": "user", "content": "more"}]},
                             headers=h)
            bad = await c.post("/v1/completions", json={"prompt": "x", "session_id": "nope"})
            return a.json(), b.json(), bad

    a, b, bad = run(go())
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == a["usage"]["prompt_tokens"] + \
        a["usage"]["completion_tokens"]
    assert bad.status_code == 404


def test_snapshot_restore_in_a_second_server_process(tiny_ckpt, tmp_path):
    snap_dir = tmp_path / "snaps"
    engine = make_engine(tiny_ckpt, context_length=4096, session_snapshot_dir=str(snap_dir))
    t1, t2, t3 = _words(8, 7), _words(5, 8), _words(6, 9)

    async def original():
        async with serving(engine) as c:
            sid = (await c.post("/open_session", json={"streaming": True, "session_id": "mig"})).json()
            _unpack(await _turn(c, t1, sid))
            _unpack(await _turn(c, t2, sid))
            snap = (await c.post(f"/sessions/{sid}/snapshot", json={"name": "mig.safetensors"})).json()
            expected = _unpack(await _turn(c, t3, sid))
            return snap, expected

    snap, expected = run(original())
    assert snap["has_state"] and snap["tokens"] > 0
    # corrupt copies are refused with a reason
    data = (snap_dir / "mig.safetensors").read_bytes()
    (snap_dir / "flipped.safetensors").write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    (snap_dir / "short.safetensors").write_bytes(data[:50])

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mambaserve.server", "serve", "--model", str(tiny_ckpt),
                             "--served-model-name", "tiny", "--port", str(port), "--context-length", "4096",
                             "--device", "cpu",  # as the first engine: a GPU machine's default is cuda, bf16
                             "--session-snapshot-dir", str(snap_dir), "--chunked-prefill-size", "16",
                             "--mamba-cache-size", "8", "--max-running-requests", "6", "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)

        async def second():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                flipped = await c.post("/sessions/restore", json={"name": "flipped.safetensors"})
                short = await c.post("/sessions/restore", json={"name": "short.safetensors"})
                traversal = await c.post("/sessions/restore", json={"name": "../etc/passwd"})
                ok = (await c.post("/sessions/restore", json={"name": "mig.safetensors"})).json()
                nxt = _unpack(await _turn(c, t3, ok["session_id"]))
                return flipped, short, traversal, ok, nxt

        flipped, short, traversal, ok, nxt = run(second())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert flipped.status_code == 400 and "checksum" in flipped.json()["error"]["message"]
    assert short.status_code == 400 and "corrupt" in short.json()["error"]["message"]
    assert traversal.status_code == 400
    assert ok["session_id"] == "mig" and ok["has_state"]
    assert nxt[0] == expected[0]
    assert nxt[1] == pytest.approx(expected[1], abs=1e-6)
    assert nxt[2] == expected[2]


def test_a_turn_opens_and_closes_its_session(tiny_ckpt):
    """``session_params.open`` / ``close``: how a client behind sglang-router (no /open_session through
    it) opens and closes a session; the rules are /open_session's."""
    engine = make_engine(tiny_ckpt, context_length=4096)

    async def go():
        r = {}
        async with serving(engine) as c:
            r["refused"] = await _turn(c, [], "s1", open=True, streaming=True)  # an empty turn: refused
            r["after_refused"] = await _turn(c, [4], "s1")
            r["first"] = await _turn(c, [4, 5, 6], "s1", open=True, streaming=True, timeout=60)
            r["again"] = await _turn(c, [7], "s1", open=True)
            r["last"] = await _turn(c, [7, 8], "s1", close=True)
            r["closed"] = await _turn(c, [9], "s1")
            r["chat"] = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "session_params": {"open": True, "close": True}}, headers={"x-smg-routing-key": "c1"})
            r["no_id"] = await c.post("/generate", json={"input_ids": [3], "session_params": {"open": True}})
            r["acc"] = await accounting(engine)
            r["metrics"] = (await c.get("/metrics")).text
        return r

    r = run(go())
    assert r["refused"].status_code == 400
    assert r["after_refused"].status_code == 404  # the refused first turn left no session
    assert "x-smg-routing-key" in r["after_refused"].json()["error"]["message"]
    assert r["first"].status_code == 200
    assert r["again"].status_code == 409 and r["again"].json()["error"]["code"] == "session_exists"
    assert r["last"].status_code == 200
    assert r["last"].json()["meta_info"]["cached_tokens"] == 3 + 5  # the live state of the first turn
    assert r["closed"].status_code == 404
    assert r["chat"].status_code == 200  # its id from the routing key
    assert r["no_id"].status_code == 400 and "x-smg-routing-key" in r["no_id"].json()["error"]["message"]
    assert r["acc"]["sessions"] == 0 and r["acc"]["held_by_sessions"] == 0
    assert_idle(r["acc"])
    assert 'mambaserve_sessions_closed_total{reason="client"} 2.0' in r["metrics"]
