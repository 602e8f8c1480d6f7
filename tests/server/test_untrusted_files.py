"""Every file the server reads back is checked beyond its checksum (a file crafted with a valid one, or written
by a bug): snapshot files, persisted session records and storage-tier entries with bad contents are refused
with a log line and a counted reason, and leave every slot free. A step that fails anyway gives back what it
had taken; what cannot be given back shows on /health."""

import asyncio
import json

import pytest
import torch

from mambaserve.server.cache import storage_entry as fmt
from mambaserve.server.cache.storage_backend import FileSystemBackend
from mambaserve.server.engine.request import SamplingParams
from mambaserve.server.sessions import snapshot
from tests.server.conftest import accounting, assert_idle, make_engine, run, serving

GREEDY = {"temperature": 0, "ignore_eos": True}


def _rejected(engine, file: str, reason: str) -> float:
    return engine.metrics.registry.get_sample_value("mambaserve_session_files_rejected_total",
                                                    {"file": file, "reason": reason}) or 0


async def _turn(c, sid, ids, n=3):
    return await c.post("/generate", json={"input_ids": ids, "session_params": {"id": sid},
                                           "sampling_params": {"max_new_tokens": n, **GREEDY}})


def _crafted(meta, tokens, state, vocab):
    """(name, changes to (meta, tokens, state), status, code, reason): each written with a valid checksum."""
    nan = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    return [
        ("past-vocab", {"tokens": tokens[:-1] + [vocab + 5]}, 400, "snapshot_invalid", "tokens"),
        ("negative", {"tokens": [-1] + tokens[1:]}, 400, "snapshot_invalid", "tokens"),
        ("strings", {"tokens": ["3"] + tokens[1:]}, 400, "snapshot_invalid", "tokens"),
        ("bools", {"tokens": [True] + tokens[1:]}, 400, "snapshot_invalid", "tokens"),
        ("in-state-past-history", {"meta": {**meta, "in_state": len(tokens) + 3}}, 400, "snapshot_invalid", "fields"),
        ("capacity-negative", {"meta": {**meta, "capacity": -1}}, 400, "snapshot_invalid", "fields"),
        ("capacity-below-history", {"meta": {**meta, "capacity": 3}}, 400, "snapshot_invalid", "fields"),
        ("timeout-negative", {"meta": {**meta, "timeout": -5}}, 400, "snapshot_invalid", "fields"),
        ("over-the-context", {"tokens": tokens * 60, "meta": {**meta, "in_state": 0}, "state": None}, 400,
         "snapshot_invalid", "too_long"),
        ("nan-state", {"state": nan}, 400, "snapshot_invalid", "state"),
        ("other-shape", {"state": {**state, "conv": state["conv"][:, :1]}}, 409, "snapshot_incompatible",
         "incompatible"),
    ]


def test_crafted_snapshot_files_are_refused_with_their_reason(tiny_ckpt, tmp_path):
    """Each file restored with 200 before (and the turn after it crashed a step or leaked a slot)."""
    engine = make_engine(tiny_ckpt, session_snapshot_dir=str(tmp_path))

    async def go():
        async with serving(engine) as c:
            sid = (await c.post("/open_session", json={"streaming": True})).json()
            assert (await _turn(c, sid, [3, 4, 5, 6])).status_code == 200
            good = await c.post(f"/sessions/{sid}/snapshot", json={"name": "good"})
            meta, tokens, state = snapshot.read(tmp_path / "good", engine.snapshots.compat)
            cases = _crafted(meta, tokens, state, engine.dims.vocab_size)
            for name, change, *_ in cases:
                snapshot.write(tmp_path / name, engine.snapshots.compat, change.get("meta", meta),
                               change.get("tokens", tokens), change.get("state", state))
            refused = [await c.post("/sessions/restore", json={"name": name, "session_id": f"r-{name}"})
                       for name, *_ in cases]
            ok = await c.post("/sessions/restore", json={"name": "good", "session_id": "again"})
            turn = await _turn(c, "again", [7])
            for s in (sid, "again"):
                await c.post("/close_session", json={"session_id": s})
            return good, cases, refused, ok, turn, await accounting(engine)

    good, cases, refused, ok, turn, acc = run(go())
    assert good.status_code == 200
    for (name, _, status, code, reason), r in zip(cases, refused):
        assert r.status_code == status and r.json()["error"]["code"] == code, (name, r.text)
    for reason in {c[4] for c in cases}:
        assert _rejected(engine, "snapshot", reason) == sum(c[4] == reason for c in cases), reason
    assert ok.status_code == 200 and turn.status_code == 200
    assert_idle(acc)
    assert acc["sessions"] == 0


def test_crafted_session_records_are_refused_with_their_reason(tiny_ckpt, tmp_path):
    """--session-persist records with a valid form but unusable contents: the turn naming the session gets
    404 as for an unknown one (before: a session whose every turn failed, or an empty one), each counted."""
    engine = make_engine(tiny_ckpt, storage_dir=str(tmp_path), session_persist=True)
    backend = FileSystemBackend(str(tmp_path))
    compat = engine.scheduler.persistence.compat
    base = {"streaming": True, "timeout": 600, "capacity": None, "history": [3, 4, 5, 6, 7], "compat": compat}
    records = {
        "capacity-negative": ({**base, "capacity": -1}, "fields"),
        "capacity-below-history": ({**base, "capacity": 3}, "fields"),
        "over-the-context": ({**base, "history": [3] * 300}, "too_long"),
        "empty": ({**base, "history": []}, "empty"),
        "strings": ({**base, "history": ["3", 4]}, "tokens"),
        "foreign": ({**base, "compat": {"other": 1}}, "incompatible"),
    }
    for sid, (record, _) in records.items():
        backend.put_record(sid, json.dumps({**record, "id": sid}).encode())
    backend.put_record("truncated", json.dumps({**base, "id": "truncated"}).encode()[:30])
    backend.put_record("fine", json.dumps({**base, "id": "fine"}).encode())

    async def go():
        async with serving(engine) as c:
            statuses = {sid: (await _turn(c, sid, [9])).status_code for sid in [*records, "truncated", "fine"]}
            await c.post("/close_session", json={"session_id": "fine"})
            return statuses, await accounting(engine)

    statuses, acc = run(go())
    assert statuses.pop("fine") == 200
    assert set(statuses.values()) == {404}
    for reason in {r for _, r in records.values()}:
        assert _rejected(engine, "record", reason) == sum(r == reason for _, r in records.values()), reason
    assert _rejected(engine, "record", "corrupt") == 1
    assert_idle(acc)


def test_a_storage_entry_with_a_valid_checksum_but_a_non_finite_state_is_deleted(tiny_ckpt, tmp_path):
    """An entry rewritten with NaN state and a recomputed checksum: refused as invalid when it is read, deleted,
    counted; the request is served as if it had missed (the same answer), nothing leaks."""
    prompt = [(5 * k * k + k) % 90 + 3 for k in range(30)]

    async def once(engine):
        async with serving(engine) as c:
            r = await c.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 4,
                                                                                        **GREEDY}})
            return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"], await accounting(engine)

    first, _, _ = run(once(make_engine(tiny_ckpt, storage_dir=str(tmp_path), cache_prefetch_policy="wait_complete")))
    path = fmt.entry_path(tmp_path, fmt.entry_name(prompt[:-1]))
    data = path.read_bytes()
    header, offset = fmt.parse_header(data)
    payload = bytearray(data[offset:-fmt.CHECKSUM_BYTES])
    payload[:4] = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
    body = data[:offset] + bytes(payload)
    import hashlib
    path.write_bytes(body + hashlib.sha256(body).digest())

    engine = make_engine(tiny_ckpt, storage_dir=str(tmp_path), cache_prefetch_policy="wait_complete")
    again, hit, acc = run(once(engine))
    assert again == first and hit == 0
    assert engine.metrics.registry.get_sample_value("mambaserve_cache_storage_rejected_entries_total",
                                                    {"reason": "invalid"}) == 1
    assert torch.isfinite(torch.frombuffer(bytearray(path.read_bytes()[offset:offset + 4]), dtype=torch.float32)).all()
    assert_idle(acc)


@pytest.fixture(params=["mamba2", "nemotron_h"])
def failing_engine(request, tiny_ckpt, nemotron):
    """An engine whose forward fails (an injected kernel failure) for any batch holding token 93."""
    engine = (make_engine(tiny_ckpt) if request.param == "mamba2" else
              make_engine(nemotron, page_size=4, chunked_prefill_size=8, mamba_cache_size=12))
    real = engine.scheduler.runner.forward

    def forward(batch):
        if 93 in batch.token_ids:
            raise RuntimeError("injected kernel failure")
        return real(batch)
    engine.scheduler.runner.forward = forward
    return engine


def test_a_failed_prefill_gives_back_what_it_took(failing_engine):
    """The failing prefill had taken a slot for its prompt's snapshot (before: leaked for good, the invariant
    check failed after every later step); afterwards every slot and page adds up, /health says OK and the
    server serves. A broken accounting that nothing can reclaim turns /health to 503."""
    engine = failing_engine

    async def go():
        async with serving(engine) as c:
            bad = await c.post("/generate", json={"input_ids": [90, 91, 92, 93, 94], "sampling_params": {
                "max_new_tokens": 3}})
            acc = await accounting(engine)
            health = await c.get("/health")
            ok = await c.post("/generate", json={"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 3}})

            def break_accounting():  # a slot the tree holds, claimed by a session too: nothing can settle it
                engine.scheduler.sessions.open("broken", True, None, None)
                slot = next(iter(engine.scheduler.cache.tree.all_slots()))
                engine.scheduler.sessions.table.sessions["broken"].slot = slot
                engine.scheduler.step = lambda: (_ for _ in ()).throw(RuntimeError("injected"))
            await engine.run_in_scheduler(break_accounting)
            while not engine.capacity_lost:
                await asyncio.sleep(0.01)
            return bad, acc, health, ok, await c.get("/health")

    bad, acc, health, ok, lost = run(go())
    assert bad.status_code == 200 and bad.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert_idle(acc)
    assert engine.metrics.registry.get_sample_value("mambaserve_reclaimed_after_failure_total",
                                                    {"resource": "state_slots"}) >= 1
    assert health.status_code == 200 and ok.status_code == 200
    assert lost.status_code == 503 and "restart the server" in lost.json()["error"]["message"]
