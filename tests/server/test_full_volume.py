"""A full storage volume (issue 33, item 5): persistence stops visibly (a gauge, a counter, /health, the
x-session-persisted header of the turns not written), and a server restarted on the still-full volume
reads it: sessions persisted before the volume filled continue from their last written turn.

The volume is full where the filesystem backend writes: its writes and its probe raise ENOSPC, as a full
disk's do (root or not, any filesystem); everything above it is the real storage tier."""

from __future__ import annotations

import errno
import json

import pytest

from mambaserve.server.cache.storage_backend import FileSystemBackend
from tests.server.conftest import accounting, make_engine, run, serving
from tests.server.test_storage_tier import GREEDY, _metric, _prompt, _resent


class Volume:
    def __init__(self, monkeypatch):
        self.full = False
        for name in ("write", "put_record", "probe"):
            real = getattr(FileSystemBackend, name)
            monkeypatch.setattr(FileSystemBackend, name, self._guard(real))

    def _guard(self, real):
        def method(backend, *args, **kw):
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(backend, *args, **kw)
        return method


@pytest.fixture
def volume(monkeypatch):
    return Volume(monkeypatch)


async def _turn(c, ids):
    r = await c.post("/generate", json={"input_ids": ids, "session_params": {"id": "chat-1"},
                                        "sampling_params": {"max_new_tokens": 4, **GREEDY}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"], r.headers.get("x-session-persisted")


def test_a_full_volume_stops_persistence_visibly_and_a_restart_on_it_still_restores(tiny_ckpt, tmp_path, volume):
    turns = [_prompt(7 + 3 * i, 70 + i) for i in range(5)]

    def engine():
        return make_engine(tiny_ckpt, storage_dir=str(tmp_path), session_persist=True,
                           cache_prefetch_policy="wait_complete")

    async def before_restart(e):
        async with serving(e) as c:
            await c.post("/open_session", json={"streaming": True, "session_id": "chat-1"})
            outs = [await _turn(c, t) for t in turns[:2]]
            # an ordinary prefix's entry (a streaming turn leaves none of its own)
            await c.post("/generate", json={"input_ids": turns[4], "sampling_params": {"max_new_tokens": 2}})
            await e.run_in_scheduler(e.scheduler.storage.drain)
            volume.full = True
            outs += [await _turn(c, t) for t in turns[2:4]]  # the first finds the disk full, the next knows
            await e.run_in_scheduler(e.scheduler.storage.drain)
            metrics = (await c.get("/metrics")).text
            health = await c.get("/health")
            acc = await accounting(e)
        return outs, metrics, health, acc

    async def after_restart(e):
        async with serving(e) as c:
            acc = await accounting(e)
            out = await _turn(c, turns[4])
            health = (await c.get("/health")).text
            async with c.stream("POST", "/generate", json={
                    "input_ids": [5, 6], "stream": True, "session_params": {"id": "chat-1"},
                    "sampling_params": {"max_new_tokens": 3, **GREEDY}}) as r:
                events = [line for line in [x async for x in r.aiter_lines()] if line.startswith("data: {")]
            out = (*out, json.loads(events[-1][6:])["meta_info"]["session_persisted"])
            await accounting(e)
        return out, acc, health

    before, metrics, health, acc = run(before_restart(engine()))
    assert [h for _, _, h in before] == ["true", "true", "false", "false"]  # each turn's write, as it went
    assert _metric(metrics, "mambaserve_cache_storage_read_only") == 1
    assert _metric(metrics, "mambaserve_cache_storage_degraded") == 1
    assert _metric(metrics, "mambaserve_session_turns_not_persisted_total") >= 1
    assert health.status_code == 200 and "read-only (No space left on device)" in health.text
    assert acc["storage_read_only"] == 1

    out, acc, health = run(after_restart(engine()))  # the volume is still full
    assert acc["storage_entries"] > 0 and acc["storage_read_only"] == 1
    assert "read-only" in health
    # the session goes on from its last persisted turn (the second), its state read from the full volume
    ids, cached, persisted, streamed = out
    ref = run(_resent(make_engine(tiny_ckpt, disable_radix_cache=True), turns[:2] + turns[4:]))
    assert ids == ref[-1] and persisted == "false" and streamed is False
    assert cached == sum(len(t) for t in turns[:2]) + sum(len(o) for o, _, _ in before[:2])

    volume.full = False  # room again: a scan finds the directory writable
    e = engine()
    assert e.scheduler.storage.writable
