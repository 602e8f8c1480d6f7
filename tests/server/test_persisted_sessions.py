"""--session-persist: a session continued on another server (or after a restart) loads its state from the
storage directory, never recomputes it; each turn is answered only once it is on storage; a damaged state is
refused, counted, and the history recomputed (the same answers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mambaserve.server.cache.storage_backend import FileSystemBackend, record_stem
from tests.server.conftest import accounting, make_engine, run, serving

GREEDY = {"temperature": 0, "ignore_eos": True}


def _words(n, seed):
    return [(seed * 31 + 7 * k * k + k) % 94 + 1 for k in range(n)]


TURNS = [_words(6 + 2 * i, 50 + i) for i in range(4)]


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def _turn(c, sid, ids, i, streaming, rid=None):
    sp = {"id": sid, **({"open": True, "streaming": streaming} if i == 0 else {}), **({"rid": rid} if rid else {})}
    r = await c.post("/generate", json={"input_ids": ids, "session_params": sp,
                                        "sampling_params": {"max_new_tokens": 4, **GREEDY}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"], r.json()["meta_info"]["id"]


def _record(root: Path, sid: str) -> dict:
    return json.loads(FileSystemBackend(root).get_record(sid))


def _persisted_tokens(record: dict) -> list[int]:
    return record["history"] if record["streaming"] else record["turns"][-1]["tokens"]


async def _undisturbed(engine, streaming):
    async with serving(engine) as c:
        got = [await _turn(c, "ref", t, i, streaming) for i, t in enumerate(TURNS)]
        await accounting(engine)
    return [(o, hit) for o, hit, _ in got]


@pytest.mark.parametrize("model", ["tiny_ckpt", "nemotron"])
@pytest.mark.parametrize("streaming", [True, False])
def test_a_session_continued_on_another_server_loads_its_state(request, tmp_path, model, streaming):
    """Two turns on A, the rest on B, whose index of the directory predates them (it scanned at its start): B
    loads the session's state (hybrids: with its KV; cached tokens as an undisturbed run's); every answer equals
    that run's, and each turn was on disk by the time it was answered."""
    ckpt = request.getfixturevalue(model)
    kw = {"page_size": 4} if model == "nemotron" else {}
    ref = run(_undisturbed(make_engine(ckpt, storage_dir=str(tmp_path / "ref"), session_persist=True, **kw),
                           streaming))
    a = make_engine(ckpt, storage_dir=str(tmp_path), session_persist=True, **kw)
    b = make_engine(ckpt, storage_dir=str(tmp_path), session_persist=True, **kw)

    async def go():
        got, records = [], []
        async with serving(a) as ca, serving(b) as cb:
            for i, t in enumerate(TURNS):
                got.append(await _turn(ca if i < 2 else cb, "s", t, i, streaming))
                records.append(_record(tmp_path, "s"))  # read as soon as the turn is answered
            # a non-streaming session's turns are a tree: a branch from its first turn, on B
            branch = await _turn(cb, "s", TURNS[3], 3, streaming, rid=got[0][2]) if not streaming else None
            metrics = (await cb.get("/metrics")).text
            await accounting(a)
            await accounting(b)
        return got, records, branch, metrics

    got, records, branch, metrics = run(go())
    assert [(o, hit) for o, hit, _ in got] == ref
    assert got[2][1] > 0  # B's first turn: loaded, not recomputed
    history = []
    for i, ((out, _, _), turn, record) in enumerate(zip(got, TURNS, records)):
        history += turn + out
        assert _persisted_tokens(record) == history  # on disk before the answer came back
        if streaming and model == "nemotron":  # each turn wrote the KV of its own tokens only
            assert record["kv"][-1] == [len(history) - len(turn) - len(out), len(history)] and len(record["kv"]) == i + 1
    assert _metric(metrics, 'mambaserve_session_restores_total{result="loaded"}') == 1
    assert _metric(metrics, "mambaserve_session_restore_seconds_count") == 1
    assert _metric(metrics, 'mambaserve_prefix_cache_hit_tokens_total{tier="storage"}') >= got[2][1]
    if branch is not None:
        assert branch[1] == ref[1][1]  # from the first turn's state, as the second turn was


def test_a_damaged_state_is_refused_and_the_history_recomputed(tiny_ckpt, tmp_path):
    """A state file with a flipped byte: refused as corrupt (counted), the session continues from its history
    recomputed, with the same answers; the restore says so."""
    a = make_engine(tiny_ckpt, storage_dir=str(tmp_path), session_persist=True)

    async def first(engine):
        async with serving(engine) as c:
            outs = [await _turn(c, "s", t, i, True) for i, t in enumerate(TURNS[:2])]
            await accounting(engine)
        return outs

    outs = run(first(a))
    record = _record(tmp_path, "s")
    path = tmp_path / "session-records" / f"{record_stem('s')}.{record['state']}.state"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    path.write_bytes(bytes(data))

    async def second(engine):
        async with serving(engine) as c:
            out = await _turn(c, "s", TURNS[2], 2, True)
            metrics = (await c.get("/metrics")).text
            await accounting(engine)
        return out, metrics

    (out, hit, _), metrics = run(second(make_engine(tiny_ckpt, storage_dir=str(tmp_path), session_persist=True)))
    ref = run(_undisturbed(make_engine(tiny_ckpt, storage_dir=str(tmp_path / "ref"), session_persist=True), True))
    assert [o for o, _, _ in outs] + [out] == [o for o, _ in ref[:3]]
    assert hit < ref[2][1]  # (what ordinary entries held of its prompts, not its state)
    assert _metric(metrics, 'mambaserve_session_restores_total{result="recomputed"}') == 1
    assert _metric(metrics, 'mambaserve_cache_storage_rejected_entries_total{reason="corrupt"}') == 1


def test_a_drain_writes_the_sessions_whose_record_is_behind(tiny_ckpt, tmp_path):
    """A session restored from a snapshot file has no record on storage until its next turn; a draining server
    (``Engine.persist_sessions``) writes it, so another server continues it, its state loaded. A session opened
    without a turn has nothing to persist and is named."""
    snaps, storage = str(tmp_path / "snaps"), str(tmp_path / "storage")

    async def first():
        async with serving(make_engine(tiny_ckpt, session_snapshot_dir=snaps)) as c:
            await _turn(c, "mig", TURNS[0], 0, True)
            await _turn(c, "mig", TURNS[1], 1, True)
            assert (await c.post("/sessions/mig/snapshot", json={})).status_code == 200
            return await _turn(c, "mig", TURNS[2], 2, True)

    async def draining(engine):
        async with serving(engine) as c:
            assert (await c.post("/sessions/restore", json={"name": "mig.safetensors"})).status_code == 200
            assert (await c.post("/open_session", json={"session_id": "empty"})).status_code == 200
            return await engine.persist_sessions(), await engine.persist_sessions()

    async def other(engine):
        async with serving(engine) as c:
            return await _turn(c, "mig", TURNS[2], 2, True), (await c.get("/metrics")).text

    expected, expected_hit, _ = run(first())
    drained = run(draining(make_engine(tiny_ckpt, session_snapshot_dir=snaps, storage_dir=storage,
                                       session_persist=True)))
    (out, hit, _), metrics = run(other(make_engine(tiny_ckpt, storage_dir=storage, session_persist=True)))
    assert drained == ((1, ["empty"]), (0, ["empty"]))  # written once: then its record is not behind
    assert out == expected and hit == expected_hit > 0
    assert _metric(metrics, 'mambaserve_session_restores_total{result="loaded"}') == 1
