"""Session ownership and fairness (issue 33, items 6 and 7): a session answers to the secret it was opened
with (and to the API key that opened it), a reopened id never touches the previous owner's snapshot
files, one client cannot fill the session table, and a session's timeout is bounded."""

from mambaserve.server.config import ServerConfig
from tests.server.conftest import make_engine, run, serving

GEN = {"sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def turn(sid: str, text: str = "x = 1\n", **params) -> dict:
    return {"text": text, "session_params": {"id": sid, **params}, **GEN}


def test_another_client_is_refused_on_a_known_session_id(tiny_ckpt, tmp_path):
    engine = make_engine(tiny_ckpt, require_session_secret=True, session_snapshot_dir=str(tmp_path))

    async def go():
        async with serving(engine) as c:
            opened = await c.post("/open_session", json={"session_id": "conv-1", "streaming": True})
            secret = opened.headers["x-session-secret"]
            first = await c.post("/generate", json=turn("conv-1", secret=secret))
            # another client knows the id: every verb is refused and changes nothing
            refused = [await c.post("/generate", json=turn("conv-1")),
                       await c.post("/generate", json=turn("conv-1", secret="guess")),
                       await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                    headers={"x-session-id": "conv-1"}),
                       await c.post("/sessions/conv-1/snapshot", json={"name": "stolen"}),
                       await c.post("/close_session", json={"session_id": "conv-1"}),
                       await c.post("/close_session", json={"session_id": "conv-1", "session_secret": "guess"})]
            # the owner goes on: header or field, its history intact
            second = await c.post("/generate", json=turn("conv-1", "y = 2\n"), headers={"x-session-secret": secret})
            info = engine.scheduler.sessions.table.sessions["conv-1"]
            history = len(info.history)
            snap = await c.post("/sessions/conv-1/snapshot", json={"name": "mine", "session_secret": secret})
            closed = await c.post("/close_session", json={"session_id": "conv-1", "session_secret": secret})
            # behind a router: the first turn opens the session, its answer carries the secret
            r1 = await c.post("/v1/chat/completions", headers={"x-smg-routing-key": "conv-2"},
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                    "session_params": {"open": True, "streaming": True}})
            r2 = await c.post("/v1/chat/completions", headers={"x-smg-routing-key": "conv-2"},
                              json={"messages": [{"role": "user", "content": "and?"}], "max_tokens": 2,
                                    "session_params": {"secret": r1.headers["x-session-secret"]}})
            r3 = await c.post("/v1/chat/completions", headers={"x-smg-routing-key": "conv-2"},
                              json={"messages": [{"role": "user", "content": "mine now"}], "max_tokens": 2,
                                    "session_params": {}})
            return first, refused, second, history, snap, closed, (r1, r2, r3)

    first, refused, second, history, snap, closed, routed = run(go())
    assert first.status_code == 200
    for r in refused:
        assert r.status_code == 403 and r.json()["error"]["code"] == "session_forbidden", r.text
    assert "x-session-secret" in refused[0].json()["error"]["message"]
    assert second.status_code == 200 and history > 0
    assert snap.status_code == 200 and closed.status_code == 200
    assert not (tmp_path / "stolen").exists()
    r1, r2, r3 = routed
    assert r1.status_code == 200 and r2.status_code == 200 and "x-session-secret" not in r2.headers
    assert r3.status_code == 403


def test_without_required_secrets_a_wrong_secret_or_api_key_is_still_refused(tiny_ckpt):
    engine = make_engine(tiny_ckpt, api_key="k-a", api_keys=("k-a", "k-b"))
    a, b = {"Authorization": "Bearer k-a"}, {"Authorization": "Bearer k-b"}

    async def go():
        async with serving(engine) as c:
            opened = await c.post("/open_session", json={"session_id": "s", "streaming": True}, headers=a)
            plain = await c.post("/generate", json=turn("s"), headers=a)  # (compatible: no secret needed)
            wrong = await c.post("/generate", json=turn("s", secret="nope"), headers=a)
            other_key = await c.post("/generate", json=turn("s", secret=opened.headers["x-session-secret"]),
                                     headers=b)
            return plain, wrong, other_key

    plain, wrong, other_key = run(go())
    assert plain.status_code == 200
    assert wrong.status_code == 403 and other_key.status_code == 403
    assert "another API key" in other_key.json()["error"]["message"]


def test_a_reopened_id_never_touches_the_previous_owners_snapshot_files(tiny_ckpt, tmp_path):
    engine = make_engine(tiny_ckpt, require_session_secret=True, session_snapshot_dir=str(tmp_path))

    async def open_turn(c, sid):
        r = await c.post("/open_session", json={"session_id": sid, "streaming": True})
        secret = r.headers["x-session-secret"]
        assert (await c.post("/generate", json=turn(sid, secret=secret))).status_code == 200
        return secret

    async def go():
        async with serving(engine) as c:
            first = await open_turn(c, "s")
            saved = await c.post("/sessions/s/snapshot", json={"name": "f1", "session_secret": first})
            await c.post("/close_session", json={"session_id": "s", "session_secret": first})
            before = (tmp_path / "f1").read_bytes()
            second = await open_turn(c, "s")  # the same id, another owner
            overwrite = await c.post("/sessions/s/snapshot", json={"name": "f1", "session_secret": second})
            default_name = await c.post("/sessions/s/snapshot", json={"session_secret": second})
            steal = await c.post("/sessions/restore", json={"name": "f1", "session_id": "t", "session_secret": second})
            back = await c.post("/sessions/restore", json={"name": "f1", "session_id": "t", "session_secret": first})
            cont = await c.post("/generate", json=turn("t", secret=first))
            return saved, before, overwrite, default_name, steal, back, cont

    saved, before, overwrite, default_name, steal, back, cont = run(go())
    assert saved.status_code == 200
    assert overwrite.status_code == 409 and overwrite.json()["error"]["code"] == "snapshot_exists"
    assert (tmp_path / "f1").read_bytes() == before
    assert default_name.status_code == 200  # its own file, under another name
    assert steal.status_code == 403
    assert back.status_code == 200 and "x-session-secret" not in back.headers  # the old secret still works
    assert cont.status_code == 200


def test_one_client_cannot_fill_the_session_table_and_timeouts_are_bounded(tiny_ckpt):
    engine = make_engine(tiny_ckpt, max_sessions=6, api_key="k-a", api_keys=("k-a", "k-b"))
    a, b = {"Authorization": "Bearer k-a"}, {"Authorization": "Bearer k-b"}

    async def go():
        async with serving(engine) as c:
            mine = [await c.post("/open_session", json={}, headers=a) for _ in range(4)]
            theirs = await c.post("/open_session", json={}, headers=b)
            week = await c.post("/open_session", json={"timeout": 7 * 24 * 3600}, headers=b)
            hour = await c.post("/open_session", json={"timeout": 3600}, headers=b)
            await c.post("/close_session", json={"session_id": mine[0].json()}, headers=a)
            again = await c.post("/open_session", json={}, headers=a)
            return mine, theirs, week, hour, again

    mine, theirs, week, hour, again = run(go())
    assert [r.status_code for r in mine] == [200, 200, 200, 429]  # half the table per key by default
    assert "--max-sessions-per-client" in mine[3].json()["error"]["message"]
    assert mine[3].json()["error"]["code"] == "too_many_sessions"
    assert theirs.status_code == 200
    assert week.status_code == 400 and "--max-session-timeout" in week.json()["error"]["message"]
    assert hour.status_code == 200
    assert again.status_code == 200  # a closed session gives its place back
    # the bound follows a longer default (an InferenceSession's timeoutSeconds may reach a week)
    assert ServerConfig(model="m", session_timeout=7200).max_session_timeout == 7200
