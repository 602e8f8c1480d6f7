"""Tensor parallelism on CPUs: two ranks (this process, the leader, and a follower process) over gloo.

Every output at TP 2 is compared with TP 1 (fp32: the same tokens, logprobs to reduction-order tolerance):
pure Mamba2 with one B/C group (the gated norm's group spans both ranks) and with two (one each), Nemotron-H
(Mamba2, attention with its KV heads split, relu2 MLP, MoE with a latent width) and Granite MoE (a shared MLP
summed with the experts in one reduction); radix-cache hits, host-tier round trips and streaming sessions at
TP 2 equal the history resent cold; a session file written at TP 2 restores at TP 1 and the reverse, and a
file in another state layout is refused. A follower killed takes the server down with a message.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from mambaserve.server.engine.request import SamplingParams
from mambaserve.server.model.config import Mamba2Dims, ModelLoadError
from mambaserve.server.model.parallel import TP, Slices, mamba_shard, merge_state, shard_state
from mambaserve.server.model.weights import load_state_dict
from mambaserve.server.sessions import snapshot
from mambaserve.server.sessions.table import SessionError, TurnParams
from tests.server.conftest import (accounting, checked_accounting, free_port, make_engine, run, run_started, serving,
                                   wait_healthy)
from tests.server.tiny_hybrids import make_hybrid_checkpoint
from tests.server.tiny_models import make_checkpoint

PROMPT = [5, 9, 22, 31, 7, 3, 60, 2, 11, 40, 41, 42, 17, 18]


async def _gen(engine, ids, n, sid=None):
    out, lps, cached = [], [], None
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    async for o in engine.generate(ids, params, return_logprob=True, session_id=sid, turn_params=TurnParams()):
        assert o.error is None, o.error
        out += o.token_ids
        lps += o.logprobs
        cached = o.cached_tokens
    return out, lps, cached


def _cold(path, prompts_and_n, **kw):
    """Each prompt sent whole to a TP-1 engine without a cache."""
    engine = make_engine(path, disable_radix_cache=True, **kw)

    async def go():
        return [await _gen(engine, p, n) for p, n in prompts_and_n]
    return run_started(engine, go)


def _same(got, ref):
    assert got[0] == ref[0]
    assert got[1] == pytest.approx(ref[1], abs=2e-5)


# ---- the shard math, without processes ----------------------------------------------------------------------

@pytest.mark.parametrize("heads,groups,size", [(6, 1, 2), (8, 1, 4), (8, 2, 2), (8, 4, 2), (16, 8, 4)])
def test_a_state_cut_into_ranks_parts_and_merged_is_itself(heads, groups, size):
    d = Mamba2Dims(vocab_size=8, hidden_size=8, num_layers=2, num_heads=heads, head_dim=2, n_groups=groups,
                   state_size=3, conv_kernel=4, chunk_size=8, eps=1e-5, use_bias=False, use_conv_bias=True,
                   residual_in_fp32=True, tie_word_embeddings=False, dt_limit=(0.0, float("inf")), eos_token_id=[],
                   max_position_embeddings=None)
    state = {"conv": torch.randn(2, d.conv_dim, 3), "ssm": torch.randn(2, heads, 2, 3)}
    parts = shard_state(state, d, size)
    for rank, part in enumerate(parts):
        local = mamba_shard(d, TP(rank, size)).local
        assert part["conv"].shape == (2, local.conv_dim, 3) and part["ssm"].shape == (2, local.num_heads, 2, 3)
        # a rank's heads read its groups: head h is in group h // (heads / groups)
        s = mamba_shard(d, TP(rank, size))
        assert {h // (heads // groups) for h in s.heads} <= set(s.groups)
    merged = merge_state(parts, d)
    assert torch.equal(merged["conv"], state["conv"]) and torch.equal(merged["ssm"], state["ssm"])


def test_what_cannot_be_split_is_refused_before_any_process_starts(tmp_path, nemotron):
    with pytest.raises(ValueError, match="--storage-dir with a hybrid model"):
        make_engine(nemotron, tensor_parallel_size=2, storage_dir=str(tmp_path / "l3"))
    three_heads = make_checkpoint(tmp_path / "h3", "h3_k2")
    with pytest.raises(ModelLoadError, match="--tensor-parallel-size 2 does not divide the model's 3 Mamba heads"):
        make_engine(three_heads, tensor_parallel_size=2)
    d = Mamba2Dims(8, 8, 1, 6, 2, 3, 3, 4, 8, 1e-5, False, True, True, False, (0.0, 1.0), [], None)
    with pytest.raises(ModelLoadError, match="neither divides the other"):
        mamba_shard(d, TP(0, 2))
    d = dataclasses.replace(d, num_heads=8, n_groups=2)
    with pytest.raises(ModelLoadError, match="each group's gated norm would span several ranks"):
        mamba_shard(d, TP(0, 4))


def test_a_rank_reads_only_its_slices_of_the_checkpoint(tiny_ckpt):
    state = load_state_dict(Path(tiny_ckpt))
    name = "backbone.layers.0.mixer.in_proj.weight"
    full = state[name].read()
    spec = Slices(0, ((0, 3), (10, 12), (full.shape[0] - 1, full.shape[0] + 2)))  # past the end: zeros
    part = state[name].read(spec)
    assert torch.equal(part[:3], full[:3]) and torch.equal(part[3:5], full[10:12])
    assert torch.equal(part[5], full[-1]) and not part[6:].any()
    col = state[name].read(Slices(1, ((4, 9),)))
    assert torch.equal(col, full[:, 4:9])


def test_a_snapshot_in_another_state_layout_is_refused(tmp_path):
    key = snapshot.compat_key({"model_type": "mamba2"}, torch.float32, torch.float32)
    state = {"conv": torch.zeros(2, 4, 3), "ssm": torch.zeros(2, 2, 2, 2)}
    snapshot.write(tmp_path / "per-rank", {**key, "state_layout": "ranks-of-2"}, {"id": "s"}, [1, 2], state)
    with pytest.raises(SessionError, match="laid out as 'ranks-of-2'.*cannot be cut") as e:
        snapshot.read(tmp_path / "per-rank", key)
    assert e.value.status == 409
    old = {k: v for k, v in key.items() if k != "state_layout"}  # a file from before layouts were recorded
    snapshot.write(tmp_path / "old", old, {"id": "s"}, [1, 2], state)
    assert snapshot.read(tmp_path / "old", key)[1] == [1, 2]


# ---- two ranks ------------------------------------------------------------------------------------------------

def test_mamba2_at_tp2_equals_tp1_with_hits_sessions_and_files_across_sizes(tiny_ckpt, tmp_path):
    """One B/C group (the gated norm's group spans the ranks). Outputs, a radix hit and a streaming session at
    TP 2 equal TP 1 cold; a session file written at TP 1 restores at TP 2, and one written at TP 2 at TP 1."""
    files = str(tmp_path / "files")
    t1, t2, t3 = PROMPT[:9], [30, 31, 32, 33], [50, 51, 52]
    tp1 = make_engine(tiny_ckpt, session_snapshot_dir=files)

    async def written_at_tp1():
        sid = await tp1.open_session("one", True, None, None)
        first = await _gen(tp1, t1, 4, sid)
        saved = await tp1.snapshot_session(sid, "from-tp1")
        return first, saved
    first1, saved1 = run_started(tp1, written_at_tp1)
    assert saved1["has_state"]

    tp2 = make_engine(tiny_ckpt, tensor_parallel_size=2, session_snapshot_dir=files)

    async def at_tp2():
        a = await _gen(tp2, PROMPT, 6)
        hit = await _gen(tp2, PROMPT + a[0] + [70, 71], 5)
        sid = await tp2.open_session("two", True, None, None)
        turns = [await _gen(tp2, t1, 4, sid), await _gen(tp2, t2, 4, sid)]
        saved = await tp2.snapshot_session(sid, "from-tp2")
        restored = await tp2.restore_session("from-tp1", "again")
        after = await _gen(tp2, t3, 4, "again")
        return a, hit, turns, saved, restored, after, checked_accounting(tp2)
    a, hit, turns, saved2, restored, after, acct = run_started(tp2, at_tp2)

    tp1 = make_engine(tiny_ckpt, session_snapshot_dir=files)

    async def restored_at_tp1():
        r = await tp1.restore_session("from-tp2", "back")
        return r, await _gen(tp1, t3, 4, "back")
    restored1, after1 = run_started(tp1, restored_at_tp1)

    h1 = t1 + turns[0][0]
    ref = _cold(tiny_ckpt, [(PROMPT, 6), (PROMPT + a[0] + [70, 71], 5), (t1, 4), (h1 + t2, 4),
                            (t1 + first1[0] + t3, 4), (h1 + t2 + turns[1][0] + t3, 4)])
    _same(a, ref[0])
    _same(hit, ref[1])
    assert hit[2] == len(PROMPT) + 6  # the first request's final state, from the radix tree
    _same(turns[0], ref[2])
    _same(turns[1], ref[3])
    assert turns[1][2] == len(h1)  # the session's live state
    assert restored["has_state"] and restored1["has_state"]
    _same(after, ref[4])  # written at TP 1, restored at TP 2
    _same(after1, ref[5])  # written at TP 2, restored at TP 1
    assert acct["running"] == 0 and acct["free"] + acct["held_by_tree"] + acct["held_by_sessions"] == acct["capacity"]


def test_mamba2_two_groups_at_tp2_with_the_host_tier(tmp_path):
    """Two B/C groups (one per rank). A pool of 4 slots sends snapshots to the host tier and back: each rank
    keeps its heads' part of every host slot."""
    path = make_checkpoint(tmp_path / "g2", "h8_g2")
    prompts = [PROMPT, PROMPT[:7] + [1, 2, 3], [40 + k for k in range(12)], PROMPT + [8, 8]]
    kw = dict(mamba_cache_size=4, max_running_requests=2, host_cache_size=1 << 20)
    tp2 = make_engine(path, tensor_parallel_size=2, **kw)

    async def go():
        return [await _gen(tp2, p, 4) for p in prompts], checked_accounting(tp2)
    got, acct = run_started(tp2, go)
    ref = _cold(path, [(p, 4) for p in prompts])
    for g, r in zip(got, ref):
        _same(g, r)
    assert got[3][2] > 0 and tp2.metrics.cache_hit.labels("host")._value.get() >= 1  # back from the host tier
    assert acct["held_by_host"] >= 1


def test_storage_entries_written_at_one_tp_size_load_at_another(tiny_ckpt, tmp_path):
    """TP 1 writes an entry, TP 2 hits it (read into rank 0's host tier, cut into the ranks' parts) and writes
    one (gathered on rank 0), TP 1 hits that: every output equals the prompt sent cold."""
    a, b = PROMPT[:12], [70 - k for k in range(12)]
    kw = dict(storage_dir=str(tmp_path / "l3"), cache_prefetch_policy="wait_complete", host_cache_size=1 << 20)

    def serve(tp, prompts):
        engine = make_engine(tiny_ckpt, tensor_parallel_size=tp, **kw)

        async def go():
            outs = [await _gen(engine, p, 4) for p in prompts]
            return outs, engine.metrics.cache_hit.labels("storage")._value.get()
        return run_started(engine, go)

    (first,), _ = serve(1, [a])
    (hit_a, wrote_b), from_storage2 = serve(2, [a + [5, 5], b])
    (hit_b,), from_storage1 = serve(1, [b + [6, 6]])
    ref = _cold(tiny_ckpt, [(a, 4), (a + [5, 5], 4), (b, 4), (b + [6, 6], 4)])
    for got, r in zip([first, hit_a, wrote_b, hit_b], ref):
        _same(got, r)
    assert hit_a[2] > 0 and hit_b[2] > 0 and from_storage2 >= 1 and from_storage1 >= 1


def test_a_persisted_session_moves_from_tp2_to_tp1(tiny_ckpt, tmp_path):
    """--session-persist: two turns on a TP-2 server (its state gathered to rank 0 and written beside its record),
    two more on a TP-1 server on the same directory, which loads that state: the answers and cached tokens are an
    undisturbed TP-1 session's."""
    from tests.server.test_persisted_sessions import TURNS, _turn, _undisturbed

    ref = run(_undisturbed(make_engine(tiny_ckpt, storage_dir=str(tmp_path / "ref"), session_persist=True), True))
    a = make_engine(tiny_ckpt, tensor_parallel_size=2, storage_dir=str(tmp_path), session_persist=True)
    b = make_engine(tiny_ckpt, storage_dir=str(tmp_path), session_persist=True)

    async def go():
        async with serving(a) as ca, serving(b) as cb:
            got = [await _turn(ca if i < 2 else cb, "s", t, i, True) for i, t in enumerate(TURNS)]
            await accounting(a)
            await accounting(b)
        return [(o, hit) for o, hit, _ in got]

    got = run(go())
    assert got == ref and got[2][1] > 0  # B's first turn: loaded, not recomputed


@pytest.mark.parametrize("family", ["nemotron_h", "granite_moe"])
def test_hybrids_at_tp2_equal_tp1(family, tmp_path):
    """Nemotron-H: Mamba2 (two groups), attention (4 heads, 2 KV heads: one each), relu2 MLP, MoE with a latent
    width and a shared expert; Granite MoE: a shared MLP and experts summed once. Greedy outputs, a radix hit
    (snapshot and KV pages) and two session turns equal TP 1 cold."""
    path = make_hybrid_checkpoint(tmp_path / family, family)
    kw = dict(page_size=4, context_length=512)
    tp2 = make_engine(path, tensor_parallel_size=2, **kw)
    t2 = [60, 61, 62, 63, 64]

    async def go():
        a = await _gen(tp2, PROMPT, 6)
        hit = await _gen(tp2, PROMPT + a[0] + [70], 4)
        sid = await tp2.open_session(None, True, None, None)
        turns = [await _gen(tp2, PROMPT[:10], 4, sid), await _gen(tp2, t2, 4, sid)]
        await tp2.close_session(sid)
        return a, hit, turns, checked_accounting(tp2)
    a, hit, turns, acct = run_started(tp2, go)
    ref = _cold(path, [(PROMPT, 6), (PROMPT + a[0] + [70], 4), (PROMPT[:10], 4),
                       (PROMPT[:10] + turns[0][0] + t2, 4)], **kw)
    for got, r in zip([a, hit, *turns], ref):
        _same(got, r)
    assert hit[2] > 0 and turns[1][2] > 0
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"]


def test_a_follower_that_dies_takes_the_server_down_with_a_message(tiny_ckpt):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mambaserve.server", "serve", "--model", str(tiny_ckpt),
                             "--port", str(port), "--device", "cpu", "--tp", "2", "--mamba-cache-size", "8",
                             "--max-running-requests", "4", "--skip-server-warmup", "--log-level", "warning"],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, timeout=120)
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        assert info["tensor_parallel_size"] == 2
        (follower,) = _children(proc.pid)
        with httpx.stream("POST", url + "/generate", timeout=30, json={
                "input_ids": PROMPT, "stream": True,
                "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}) as r:
            lines = r.iter_lines()
            next(lines)  # decoding
            os.kill(follower, signal.SIGKILL)
            with pytest.raises(httpx.TransportError):
                for _ in lines:
                    pass
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stderr.read()
    assert code == 1, log[-3000:]
    assert f"tensor-parallel rank 1 (pid {follower}) ended with signal SIGKILL" in log and "server stops" in log


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{pid}\n" in status and "python" in (entry / "cmdline").read_text():
                out.append(int(entry.name))
    return out
