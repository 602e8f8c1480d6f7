"""The storage cache tier (L3): snapshots written to a directory, found again by prefix after a restart
or by another server on the same directory, bit for bit; entries of another model or damaged ones are
never loaded; a directory that fails turns the tier off without failing a request."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from mambaserve.server.cache import storage_entry as fmt
from mambaserve.server.cache.prefix_cache import StateOps
from tests.server.conftest import accounting, make_engine, run, serving
from tests.server.tiny_models import make_checkpoint

GREEDY = {"temperature": 0, "ignore_eos": True}


def _prompt(n, seed):
    return [(seed * 31 + 7 * k * k + k) % 94 + 1 for k in range(n)]


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _entries(root: Path) -> list[Path]:
    return sorted((root / "entries").glob("*/*.l3"))


def _storage_engine(ckpt, root, **kw):
    kw.setdefault("cache_prefetch_policy", "wait_complete")
    return make_engine(ckpt, storage_dir=str(root), **kw)


async def _generate(c, ids, n=4):
    r = await c.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                        "sampling_params": {"max_new_tokens": n, **GREEDY}})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["output_ids"], body["meta_info"]["cached_tokens"]


def _serve_once(engine, prompts):
    async def go():
        async with serving(engine) as c:
            outs = [await _generate(c, p) for p in prompts]
            metrics = (await c.get("/metrics")).text
            acc = await accounting(engine)
        return outs, metrics, acc
    return run(go())


# ---- units: names, bytes ------------------------------------------------------------------------------

def test_entry_names_chain_over_pages_and_depend_on_tokens_only():
    assert fmt.entry_name([1, 2, 3]) == fmt.entry_name((1, 2, 3))
    assert fmt.entry_name([1, 2, 3]) != fmt.entry_name([1, 2, 4])
    assert fmt.entry_name([1, 2, 3, 4], 2) != fmt.entry_name([1, 2, 3, 4], 1)
    head = fmt.header_bytes({"m": 1}, [5, 6], 1, {"conv": [1]}, 8)
    header, offset = fmt.parse_header(head)
    assert header["tokens"] == [5, 6] and offset == len(head)
    for bad in (b"nope", head[:-3], b"X" + head[1:]):
        with pytest.raises(fmt.EntryError) as e:
            fmt.parse_header(bad)
        assert e.value.reason == "corrupt"
    with pytest.raises(fmt.EntryError) as e:
        fmt.check_compatible(header, {"m": 2})
    assert e.value.reason == "incompatible"


def test_host_tier_drops_what_storage_has_a_copy_of_first():
    from mambaserve.server.cache.host_tier import HostTier

    host = HostTier(2)
    host.store([1, 1])
    host.store([2, 2])  # more recent than [1, 1], but on storage too
    lock = host.lock_exact([2, 2])
    lock.node.stored = True
    host.unlock(lock)
    assert host.store([3, 3]) is not None
    assert host.tree.match_prefix([1, 1, 9]).length == 2 and host.tree.match_prefix([2, 2, 9]).length == 0
    slot = host.reserve()  # a read's slot: in no tree until it lands
    assert slot is not None and slot in host.reserved
    host.check_invariants()
    host.commit([4, 4], slot)
    assert not host.reserved and host.tree.match_prefix([4, 4, 9]).length == 2
    host.check_invariants()


# ---- the data path -------------------------------------------------------------------------------------

def test_round_trip_gpu_host_storage_into_a_new_server_is_bit_exact(tiny_ckpt, tmp_path):
    """A device slot goes device -> host -> disk in one engine; a second engine on the directory reads it
    disk -> host and loads it host -> device: the same bytes."""
    a = _storage_engine(tiny_ckpt, tmp_path)
    sched, runner = a.scheduler, a.scheduler.runner
    g = torch.Generator().manual_seed(0)
    state = {"conv": torch.randn(runner.pool.conv[:, 0].shape, generator=g).to(runner.pool.conv.dtype),
             "ssm": torch.randn(runner.pool.ssm[:, 0].shape, generator=g).to(runner.pool.ssm.dtype)}
    runner.write_slot(2, state)
    key = _prompt(13, 1)
    assert sched.cache.write_to_storage(key, 2)
    runner.apply_state_ops(sched.cache.take_pending())  # the offload, then the write is queued
    sched.storage.drain()
    sched._drain_inbox(block=False)
    assert sched.storage.has(key) and len(_entries(tmp_path)) == 1
    sched.check_invariants()

    b = _storage_engine(tiny_ckpt, tmp_path)
    sched, runner = b.scheduler, b.scheduler.runner
    assert sched.cache.residency(key + [7]) == {"gpu": 0, "host": 0, "storage": 13}
    ticket = sched.storage.prefetch(key + [7], 0)
    sched.storage.drain()
    sched._drain_inbox(block=False)
    assert ticket.done
    cached, lock, tier = sched.cache.match(key + [7])
    assert (cached, tier) == (13, "storage")
    runner.apply_state_ops(StateOps([("load", lock.slot, 5)]))
    sched.cache.unlock(lock)
    back = runner.read_slot(5)
    assert torch.equal(back["conv"], state["conv"]) and torch.equal(back["ssm"], state["ssm"])
    sched.check_invariants()


@pytest.mark.parametrize("policy, wait", [("best_effort", 0.0), ("timeout", 0.25), ("wait_complete", float("inf"))])
def test_prefetch_policy_decides_how_long_admission_holds_a_request(tiny_ckpt, tmp_path, policy, wait):
    prompt = _prompt(30, 11)
    _serve_once(_storage_engine(tiny_ckpt, tmp_path), [prompt])
    sched = _storage_engine(tiny_ckpt, tmp_path, cache_prefetch_policy=policy,
                            cache_prefetch_timeout=0.25).scheduler
    ticket = sched.storage.prefetch(prompt[:-1], 0, now=100.0)
    assert ticket.deadline == 100.0 + wait
    assert ticket.holds(100.2) == (wait > 0.2) and ticket.holds(100.3) == (wait > 0.3)
    sched.storage.drain()
    sched._drain_inbox(block=False)
    assert ticket.done and not ticket.holds(100.0)  # landed: nobody waits any more
    assert sched.cache.residency(prompt[:-1])["host"] == len(prompt) - 1
    sched.check_invariants()


def test_twenty_conversations_on_two_device_snapshots_keep_hitting_through_host_and_storage(tiny_ckpt, tmp_path):
    """Twenty conversations, three turns each, one running at a time: a device pool of three slots (one
    running, two snapshots), a host tier of four: later turns hit from host or storage, and every
    greedy answer equals a cold engine's."""
    per = make_engine(tiny_ckpt).pool.bytes_per_slot
    warm = _storage_engine(tiny_ckpt, tmp_path, mamba_cache_size=3, max_running_requests=1,
                           host_cache_size=4 * per)
    cold = make_engine(tiny_ckpt, disable_radix_cache=True)

    async def converse(engine):
        convs = [_prompt(18, s) for s in range(20)]
        outs, cached = [], []
        async with serving(engine) as c:
            for turn in range(3):
                for i in range(20):
                    out, hit = await _generate(c, convs[i], 3)
                    outs.append(out)
                    cached.append(hit)
                    convs[i] = convs[i] + out + _prompt(4, 100 * turn + i)
                    if engine.scheduler.storage is not None:
                        # the disk keeps up: a write still queued keeps its host entry locked, and with all
                        # four locked (a loaded machine) later snapshots are dropped, by design
                        await engine.run_in_scheduler(engine.scheduler.storage.drain)
            metrics = (await c.get("/metrics")).text
            acc = await accounting(engine)
        return outs, cached, metrics, acc

    w_outs, w_cached, metrics, acc = run(converse(warm))
    c_outs, _, _, _ = run(converse(cold))
    assert w_outs == c_outs
    assert not acc["storage_degraded"]
    assert all(n > 0 for n in w_cached[20:]), str(w_cached)
    assert _metric(metrics, 'mambaserve_prefix_cache_hit_tokens_total{tier="storage"}') > 0
    assert _metric(metrics, 'mambaserve_cache_tier_bytes_total{direction="host_to_storage"}') > 0
    assert _metric(metrics, "mambaserve_cache_storage_load_seconds_count") > 0
    assert acc["storage_entries"] > 0


def test_a_stalled_disk_pins_at_most_half_the_host_tier(tiny_ckpt, tmp_path, monkeypatch):
    """Writes that never finish (a hung volume) keep their host entries locked; past half of the host tier
    new writes are skipped, so the host tier still takes what the device evicts and a recent conversation
    hits from it."""
    from mambaserve.server.cache import storage_worker

    stall = threading.Event()
    write = storage_worker.StorageWorker._write
    monkeypatch.setattr(storage_worker.StorageWorker, "_write", lambda self, job: (stall.wait(60), write(self, job))[1])
    per = make_engine(tiny_ckpt).pool.bytes_per_slot
    engine = _storage_engine(tiny_ckpt, tmp_path, mamba_cache_size=3, max_running_requests=1,
                             host_cache_size=4 * per)

    async def go():
        async with serving(engine) as c:
            convs = [_prompt(18, s) for s in range(8)]
            for i, p in enumerate(convs):
                out, _ = await _generate(c, p, 3)
                convs[i] = p + out + _prompt(4, 50 + i)
            writing = await engine.run_in_scheduler(lambda: len(engine.scheduler.storage.writing))
            _, hit = await _generate(c, convs[5], 3)  # evicted from the device (it keeps 6 and 7)
            metrics = (await c.get("/metrics")).text
            stall.set()
            return writing, hit, metrics, await accounting(engine)

    writing, hit, metrics, acc = run(go())
    assert writing == 2
    assert hit == 18 + 3  # its prompt and answer (the last token folded into the state)
    assert _metric(metrics, 'mambaserve_prefix_cache_hit_tokens_total{tier="host"}') == hit
    assert acc["running"] == 0


def test_restart_hits_from_storage_with_identical_output(tiny_ckpt, tmp_path):
    prompt = _prompt(30, 3)
    [(first, hit)], _, _ = _serve_once(_storage_engine(tiny_ckpt, tmp_path), [prompt])
    assert hit == 0 and _entries(tmp_path)
    [(again, hit)], metrics, acc = _serve_once(_storage_engine(tiny_ckpt, tmp_path), [prompt])
    assert again == first and hit == len(prompt) - 1
    assert _metric(metrics, 'mambaserve_prefix_cache_hit_tokens_total{tier="storage"}') == hit
    assert _metric(metrics, 'mambaserve_cache_tier_bytes_total{direction="storage_to_host"}') > 0


@pytest.mark.parametrize("change", ["weights", "state_dtype"])
def test_another_model_or_dtype_loads_nothing(tiny_ckpt, tmp_path, change):
    prompt = _prompt(30, 4)
    root = tmp_path / "l3"
    _serve_once(_storage_engine(tiny_ckpt, root), [prompt])
    written = _entries(root)
    if change == "weights":  # same architecture and shapes, other weights
        other = make_checkpoint(tmp_path / "other", "h6_g1", seed=1)
        engine, cold = _storage_engine(other, root), make_engine(other, disable_radix_cache=True)
    else:
        engine = _storage_engine(tiny_ckpt, root, state_dtype="bfloat16")
        cold = make_engine(tiny_ckpt, state_dtype="bfloat16", disable_radix_cache=True)
    [(out, hit)], metrics, _ = _serve_once(engine, [prompt])
    assert hit == 0
    assert _metric(metrics, 'mambaserve_cache_storage_rejected_entries_total{reason="incompatible"}') >= 1
    assert _metric(metrics, 'mambaserve_prefix_cache_hit_tokens_total{tier="storage"}') == 0
    assert set(written) <= set(_entries(root))  # another model's entries are left alone
    [(cold_out, _)], _, _ = _serve_once(cold, [prompt])
    assert out == cold_out


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "flip_header"])
def test_a_damaged_entry_is_skipped_counted_deleted_and_the_request_served(tiny_ckpt, tmp_path, damage):
    prompt = _prompt(30, 5)
    [(first, _)], _, _ = _serve_once(_storage_engine(tiny_ckpt, tmp_path), [prompt])
    files = [f for f in _entries(tmp_path) if f.stem == fmt.entry_name(prompt[:-1])]  # what a resend reads
    assert len(files) == 1
    original = files[0].read_bytes()
    for f in files:
        data = bytearray(f.read_bytes())
        if damage == "flip_payload":
            data[-100] ^= 0x40
        elif damage == "flip_header":
            data[3] ^= 0x01
        else:
            data = data[:len(data) // 2]
        f.write_bytes(bytes(data))
    [(again, hit)], metrics, acc = _serve_once(_storage_engine(tiny_ckpt, tmp_path), [prompt])
    assert again == first and hit == 0
    assert _metric(metrics, 'mambaserve_cache_storage_rejected_entries_total{reason="corrupt"}') == len(files)
    # deleted, and written again whole by the request that missed it (the same state, the same bytes)
    assert files[0].read_bytes() == original
    assert not acc["storage_degraded"]


@contextlib.contextmanager
def _read_only(path: Path):
    """A directory nobody may write to (as root: the immutable attribute, where the kernel allows it)."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("cannot make a directory read-only as root here (no chattr +i)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_read_only_directory_degrades_and_requests_are_served(tiny_ckpt, tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    prompt = _prompt(25, 6)
    with _read_only(root):
        [(out, _), (again, hit)], metrics, acc = _serve_once(_storage_engine(tiny_ckpt, root), [prompt, prompt])
    assert again == out and hit > 0  # the tiers above still serve
    assert acc["storage_degraded"] and _metric(metrics, "mambaserve_cache_storage_degraded") == 1
    [(cold, _)], _, _ = _serve_once(make_engine(tiny_ckpt, disable_radix_cache=True), [prompt])
    assert out == cold


def test_vanished_directory_degrades_and_requests_are_served(tiny_ckpt, tmp_path):
    root = tmp_path / "gone"
    engine = _storage_engine(tiny_ckpt, root)
    prompts = [_prompt(25, s) for s in range(4)]

    async def go():
        async with serving(engine) as c:
            outs = [await _generate(c, prompts[0])]
            await engine.run_in_scheduler(engine.scheduler.storage.drain)
            while root.exists():  # (the storage thread may be writing into it: it goes away mid-write)
                shutil.rmtree(root, ignore_errors=True)
            outs += [await _generate(c, p) for p in prompts[1:]]
            await engine.run_in_scheduler(engine.scheduler.storage.drain)
            outs.append(await _generate(c, prompts[0]))
            metrics = (await c.get("/metrics")).text
            acc = await accounting(engine)
        return outs, metrics, acc

    outs, metrics, acc = run(go())
    assert acc["storage_degraded"] and _metric(metrics, "mambaserve_cache_storage_degraded") == 1
    assert not root.exists()  # not recreated on the local disk
    cold = make_engine(tiny_ckpt, disable_radix_cache=True)
    cold_outs, _, _ = _serve_once(cold, prompts + [prompts[0]])
    assert [o for o, _ in outs] == [o for o, _ in cold_outs]


def test_storage_size_keeps_the_most_recent_entries(tiny_ckpt, tmp_path):
    per = make_engine(tiny_ckpt).pool.bytes_per_slot
    engine = _storage_engine(tiny_ckpt, tmp_path, storage_size=3 * per + 4096)  # three entries, not four
    prompts = [_prompt(20, s) for s in range(6)]
    _, metrics, acc = _serve_once(engine, prompts)
    assert acc["storage_entries"] <= 3 and acc["storage_bytes"] <= acc["storage_capacity_bytes"]
    assert _metric(metrics, 'mambaserve_cache_evictions_total{tier="storage"}') >= 3
    assert len(_entries(tmp_path)) <= 3  # (the last writes and deletes land as the server stops)
    engine = _storage_engine(tiny_ckpt, tmp_path)  # the newest is still there, the oldest gone
    assert len(engine.scheduler.storage.entries) == len(_entries(tmp_path))
    [(_, hit_new), (_, hit_old)], _, _ = _serve_once(engine, [prompts[-1], prompts[0]])
    assert hit_new > 0 and hit_old == 0


def test_write_through_selective_writes_only_after_n_hits(tiny_ckpt, tmp_path):
    engine = _storage_engine(tiny_ckpt, tmp_path, cache_write_policy="write_through_selective",
                             cache_write_threshold=2)
    hot, cold_prompt = _prompt(20, 7), _prompt(20, 8)
    _serve_once(engine, [hot, cold_prompt, hot])
    assert not _entries(tmp_path)  # one hit each so far
    _serve_once(engine, [hot])
    names = {p.stem for p in _entries(tmp_path)}
    assert names == {fmt.entry_name(hot[:-1])}


def test_write_back_writes_what_the_host_tier_is_about_to_drop(tiny_ckpt, tmp_path):
    per = make_engine(tiny_ckpt).pool.bytes_per_slot
    engine = _storage_engine(tiny_ckpt, tmp_path, cache_write_policy="write_back", mamba_cache_size=3,
                             max_running_requests=1, host_cache_size=4 * per)
    _serve_once(engine, [_prompt(20, 20)])
    assert not _entries(tmp_path)  # the host tier has room: nothing written yet
    prompts = [_prompt(20, s) for s in range(21, 29)]
    _, metrics, acc = _serve_once(engine, prompts)
    assert _entries(tmp_path)
    # everything that left the device is in the host tier or on disk: the first prompt too
    [(_, hit)], _, _ = _serve_once(_storage_engine(tiny_ckpt, tmp_path), [_prompt(20, 20)])
    assert hit > 0


# ---- two servers, sessions ----------------------------------------------------------------------------

def test_two_servers_on_one_directory_share_prefixes(tiny_ckpt, tmp_path):
    """A prefix one server computed is a hit in another already running on the same directory, once that
    one has rescanned (every few seconds; here at once)."""
    a, b = _storage_engine(tiny_ckpt, tmp_path), _storage_engine(tiny_ckpt, tmp_path)
    prompt = _prompt(30, 9)

    async def go():
        async with serving(a) as ca, serving(b) as cb:
            first = await _generate(ca, prompt)
            await a.run_in_scheduler(a.scheduler.storage.drain)
            await b.run_in_scheduler(b.scheduler.storage.rescan)
            await b.run_in_scheduler(b.scheduler.storage.drain)
            second = await _generate(cb, prompt)
            await accounting(a)
            await accounting(b)
        return first, second

    (out_a, hit_a), (out_b, hit_b) = run(go())
    assert hit_a == 0 and hit_b == len(prompt) - 1 and out_a == out_b


def _session_turns():
    return [_prompt(7 + 3 * i, 40 + i) for i in range(4)]


async def _session_turn(c, sid, ids):
    r = await c.post("/generate", json={"input_ids": ids, "return_logprob": True, "session_params": {"id": sid},
                                        "sampling_params": {"max_new_tokens": 4, **GREEDY}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"]


def test_persisted_session_continues_after_a_restart_as_if_uninterrupted(tiny_ckpt, tmp_path):
    turns = _session_turns()

    async def first_half(engine):
        async with serving(engine) as c:
            sid = (await c.post("/open_session", json={"streaming": True, "session_id": "chat-1"})).json()
            outs = [await _session_turn(c, sid, t) for t in turns[:2]]
            await accounting(engine)
        return sid, outs

    async def second_half(engine, sid):
        async with serving(engine) as c:
            outs = [await _session_turn(c, sid, t) for t in turns[2:]]
            metrics = (await c.get("/metrics")).text
            closed = await c.post("/close_session", json={"session_id": sid})
            assert closed.status_code == 200
            await accounting(engine)
        return outs, metrics

    sid, before = run(first_half(_storage_engine(tiny_ckpt, tmp_path, session_persist=True)))
    assert sid == "chat-1" and len(list((tmp_path / "session-records").glob("*.json"))) == 1
    after, metrics = run(second_half(_storage_engine(tiny_ckpt, tmp_path, session_persist=True), sid))
    ref = run(_resent(make_engine(tiny_ckpt, disable_radix_cache=True), turns))
    assert [o for o, _ in before + after] == ref
    history = sum(len(t) for t in turns[:2]) + sum(len(o) for o, _ in before)
    assert after[0][1] == history  # the whole history came back from storage, nothing was prefilled again
    assert _metric(metrics, "mambaserve_session_restores_total") == 1
    assert not list((tmp_path / "session-records").glob("*.json"))  # closed: its record is gone

    # a session nobody persisted is still unknown
    async def unknown(engine):
        async with serving(engine) as c:
            r = await c.post("/generate", json={"input_ids": [1, 2], "session_params": {"id": "nope"},
                                                "sampling_params": {"max_new_tokens": 1}})
            await accounting(engine)
            return r.status_code
    assert run(unknown(_storage_engine(tiny_ckpt, tmp_path, session_persist=True))) == 404


def test_idle_sessions_spill_to_the_host_under_pressure_and_come_back(tiny_ckpt):
    """Three idle streaming sessions hold three of four device slots; two requests at once need two:
    the least recently active session's live state moves to the host tier, and its next turn comes
    back from there whole (no token prefilled again), answers equal to a resent history's."""
    per = make_engine(tiny_ckpt).pool.bytes_per_slot
    engine = make_engine(tiny_ckpt, mamba_cache_size=4, max_running_requests=2, session_slot_fraction=0.75,
                         host_cache_size=8 * per)
    turns = _session_turns()

    async def go():
        async with serving(engine) as c:
            sids = [(await c.post("/open_session", json={"streaming": True})).json() for _ in range(3)]
            first = [await _session_turn(c, sid, turns[0]) for sid in sids]
            acc = await accounting(engine)
            assert acc["held_by_sessions"] == 3
            await asyncio.gather(_generate(c, _prompt(20, 60)), _generate(c, _prompt(20, 61)))
            acc = await accounting(engine)
            second = [await _session_turn(c, sid, turns[1]) for sid in sids]
            metrics = (await c.get("/metrics")).text
            for sid in sids:
                await c.post("/close_session", json={"session_id": sid})
            await accounting(engine)
        return first, second, acc, metrics

    first, second, acc, metrics = run(go())
    assert acc["held_by_sessions"] < 3  # someone spilled
    history = len(turns[0]) + len(first[0][0])
    assert all(hit == history for _, hit in second), second
    assert _metric(metrics, 'mambaserve_prefix_cache_hit_tokens_total{tier="host"}') >= history
    ref = run(_resent(make_engine(tiny_ckpt, disable_radix_cache=True), turns[:2]))
    assert all([o1, o2] == ref for (o1, _), (o2, _) in zip(first, second))


async def _resent(engine, turns):
    async with serving(engine) as c:
        history, outs = [], []
        for t in turns:
            history += t
            out, _ = await _generate(c, history)
            history += out
            outs.append(out)
    return outs


def test_a_closed_session_leaves_no_record_behind(tiny_ckpt, tmp_path):
    """A turn's record is queued at its end; a close right after it must win, whatever the order."""
    engine = _storage_engine(tiny_ckpt, tmp_path, session_persist=True)

    async def go():
        async with serving(engine) as c:
            for i in range(3):
                sid = (await c.post("/open_session", json={"streaming": True, "session_id": f"s{i}"})).json()
                await _session_turn(c, sid, _prompt(9, i))
                assert (await c.post("/close_session", json={"session_id": sid})).status_code == 200
            await accounting(engine)
            await engine.run_in_scheduler(engine.scheduler.storage.drain)

    run(go())
    assert not list((tmp_path / "session-records").iterdir())  # nor the state files they named
