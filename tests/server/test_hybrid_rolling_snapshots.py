"""Hybrid models' decode-time snapshots (engine/rolling_snapshots.py): a stateless chat's next turn (history +
answer + new words) hits at the previous turn's prompt + answer page boundary, not only at its prompt's,
with the cold engine's greedy outputs and logprobs; with slots scarce the rolling slot is skipped or taken
back (before admission evicts a snapshot) and everything still finishes; an abort or a failure mid-decode
leaves every slot and page accounted for (the invariant check runs after every step); state copies run in
the order recorded."""

import asyncio

import pytest
import torch

from mambaserve.server.cache.prefix_cache import StateOps
from mambaserve.server.engine.request import SamplingParams
from tests.server.conftest import assert_idle, checked_accounting, greedy, make_engine, run_started

# (new user words, answer tokens) per turn: answers cross page boundaries at 4 and 16, and some turns end on one
TURNS = [(21, 11), (5, 9), (7, 13), (3, 17), (6, 10), (4, 12)]


def _engine(path, **kw):
    return make_engine(path, **{**dict(context_length=256, chunked_prefill_size=32, max_running_requests=4, mamba_cache_size=16), **kw})



def _words(n, seed):
    return [(seed * 37 + 5 * k * k + 3 * k) % 94 + 1 for k in range(n)]


async def _chat(engine, seed=0):
    """One stateless conversation: every turn resends the whole history."""
    history, out = [], []
    for i, (words, answer) in enumerate(TURNS):
        history += _words(words, seed * 10 + i)
        got = await greedy(engine, history, answer)
        out.append((len(history), *got))
        history += got[0]
    return out


@pytest.mark.parametrize("page_size,overlap", [(4, True), (16, True), (4, False)])
def test_chat_turns_hit_past_the_previous_answer(nemotron, page_size, overlap):
    kw = dict(page_size=page_size, disable_overlap_schedule=not overlap)
    warm = _engine(nemotron, **kw)

    async def go():
        return await _chat(warm), checked_accounting(warm)
    got, acct = run_started(warm, go)
    cold = _engine(nemotron, **kw, disable_radix_cache=True)
    ref = run_started(cold, lambda: _chat(cold))
    for (_, ids, lps, _), (_, rids, rlps, rcached) in zip(got, ref):
        assert ids == rids
        assert lps == pytest.approx(rlps, abs=1e-4)
        assert rcached == 0
    # A turn's state covers prompt + answer when it ends (overlap scheduling runs the last sampled token once
    # more), else all but that token; the next turn hits at that length's page boundary: the final state
    # itself where it is on one, else the rolling snapshot.
    ends = [p + len(ids) - (0 if overlap else 1) for p, ids, _, _ in got]
    expected = [0] + [e - e % page_size for e in ends[:-1]]
    assert [c for *_, c in got] == expected
    prompt_only = [0] + [p - 1 - (p - 1) % page_size for p, *_ in got[:-1]]  # what the tree kept before
    assert sum(expected) > sum(prompt_only) + len(TURNS) * page_size // 2
    assert_idle(acct)
    assert acct["rolling_snapshots"] == 0 and warm.scheduler.rolling.skipped == 0
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"]


def test_a_warmed_server_keeps_taking_rolling_snapshots(nemotron):
    """Six conversations one after another on 16 slots: once the tree holds every slot, a rolling slot
    comes from evicting the least recently used snapshot of an earlier conversation, so every
    conversation's turns hit past its previous answer, not only the first one's."""
    page_size = 4
    warm = _engine(nemotron, page_size=page_size, mamba_cache_size=16)

    async def go():
        return [await _chat(warm, seed=s) for s in range(6)], checked_accounting(warm)
    chats, acct = run_started(warm, go)
    for chat in chats:
        ends = [p + len(ids) for p, ids, _, _ in chat]  # (overlap scheduling: the state covers the answer)
        assert [c for *_, c in chat] == [0] + [e - e % page_size for e in ends[:-1]]
    assert warm.scheduler.rolling.skipped == 0
    assert_idle(acct)


def test_scarce_slots_skip_or_give_back_the_rolling_slot(nemotron):
    """Four conversations at once on 5 state slots (4 running requests): a rolling slot is taken only when
    one is free, admission takes it back before it evicts or waits, and every turn gives the cold engine's
    outputs; afterwards every slot and page is free or the tree's."""
    kw = dict(page_size=4, mamba_cache_size=5, max_running_requests=4, chunked_prefill_size=16)
    warm = _engine(nemotron, **kw)

    async def go():
        chats = await asyncio.gather(*[_chat(warm, seed=s) for s in range(4)])
        return chats, checked_accounting(warm)
    got, acct = run_started(warm, go)
    cold = _engine(nemotron, **kw, disable_radix_cache=True)

    async def go_cold():
        return await asyncio.gather(*[_chat(cold, seed=s) for s in range(4)])
    ref = run_started(cold, go_cold)
    for chat, rchat in zip(got, ref):
        for (_, ids, lps, _), (_, rids, rlps, _) in zip(chat, rchat):
            assert ids == rids
            assert lps == pytest.approx(rlps, abs=1e-4)
    rolling = warm.scheduler.rolling
    assert rolling.skipped > 0 and rolling.reclaimed > 0
    assert sum(c for chat in got for *_, c in chat) > 0
    assert_idle(acct)
    assert acct["rolling_snapshots"] == 0
    assert acct["kv_pages_free"] + acct["kv_pages_tree"] == acct["kv_pages"]


def test_abort_and_failure_mid_decode_leave_nothing_behind(nemotron):
    """A request aborted while it decodes past page boundaries gives its rolling snapshot to the tree (its
    state there is valid: a resend of its tokens hits it); one failed by an error frees it."""
    engine = _engine(nemotron, page_size=4)
    prompts = {"abort": _words(13, 5), "fail": _words(13, 6)}

    async def go():
        out = {}
        for how in ("abort", "fail"):
            gen = engine.generate(prompts[how], SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True),
                                  rid=how)
            ids = []
            async for o in gen:
                ids += o.token_ids
                if len(ids) >= 10:
                    held = await engine.run_in_scheduler(lambda: engine.scheduler.queues.by_rid[how].rolling)
                    if held is not None and held[1] >= 20:
                        break
            else:
                raise AssertionError("the request ended by itself")
            before = checked_accounting(engine)
            if how == "abort":
                engine.abort(how)
            else:
                await engine.run_in_scheduler(lambda: engine.scheduler.output.fail_running("injected"))
            async for o in gen:
                ids += o.token_ids
            out[how] = held, ids, before, checked_accounting(engine)
        return out
    out = run_started(engine, go)
    for how in ("abort", "fail"):
        (slot, n), ids, before, after = out[how]
        assert before["rolling_snapshots"] == 1 and before["held_by_requests"] == 2
        assert_idle(after)
        assert after["rolling_snapshots"] == 0
        assert after["kv_pages_free"] + after["kv_pages_tree"] == after["kv_pages"]
        hit = engine.scheduler.cache.tree.match_prefix(prompts[how] + ids).length
        if how == "abort":
            assert hit >= n  # the rolling snapshot (or a later final state on a page) is in the tree
        else:
            assert hit == 12  # the prompt's snapshot before its last token; nothing of the failed decode


def test_state_ops_run_in_the_order_recorded(nemotron):
    """One launch copies in parallel, so a copy into a slot a copy before it (in the same step's ops) reads,
    or from one it writes, waits for the next launch: a rolling copy into a free slot whose last snapshot
    had a copy from it pending gets what it should, and so does the copy that read it first."""
    ops = StateOps([("copy", 1, 2), ("copy", 3, 4), ("copy", 5, 1), ("copy", 2, 6), ("clear", 7, 7),
                    ("copy", 8, 9), ("copy", 8, 10), ("copy", 11, 9)])
    assert ops.runs() == [("copy", [(1, 2), (3, 4)]), ("copy", [(5, 1), (2, 6)]), ("clear", [(7, 7)]),
                          ("copy", [(8, 9), (8, 10)]), ("copy", [(11, 9)])]
    runner = _engine(nemotron, page_size=4).scheduler.runner
    fill = {s: torch.full_like(runner.read_slot(0)["ssm"], float(s)) for s in range(12)}
    for s, v in fill.items():
        runner.write_slot(s, {"conv": runner.read_slot(s)["conv"], "ssm": v})
    runner.apply_state_ops(ops)
    got = {s: runner.read_slot(s)["ssm"].flatten()[0].item() for s in range(12)}
    # sequentially: 2 <- 1 (1.0), 4 <- 3, 1 <- 5, 6 <- 2 (now 1.0), 7 cleared, 9 <- 8, 10 <- 8, 9 <- 11
    assert got == {0: 0.0, 1: 5.0, 2: 1.0, 3: 3.0, 4: 3.0, 5: 5.0, 6: 1.0, 7: 0.0, 8: 8.0, 9: 11.0, 10: 8.0,
                   11: 11.0}


def test_a_waiting_request_takes_a_rolling_slot_before_anything_is_evicted(nemotron):
    """The scheduler stepped by hand on 6 state slots: two requests decode, each with its slot, its prompt's
    snapshot in the tree and a rolling slot, so none is free. A third request is admitted at the next step
    with the newest rolling slot: no snapshot is evicted, and the others' outputs stay the cold engine's."""
    engine = _engine(nemotron, page_size=4, mamba_cache_size=6, max_running_requests=3)
    sched = engine.scheduler
    params = lambda n: SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    prompts = [_words(13, 1), _words(13, 2), _words(3, 3)]  # 13: a snapshot at 12; 3: none (no page boundary)

    async def go():
        gens = [engine.generate(prompts[0], params(24)), engine.generate(prompts[1], params(24))]
        for _ in range(20):
            sched._drain_inbox(block=False)
            sched.step()
            if len(sched.rolling) == 2:
                break
        acct = sched.accounting()
        assert acct["free"] == 0 and acct["held_by_tree"] == 2 and acct["held_by_requests"] == 4, acct
        evicted = engine.metrics.registry.get_sample_value("mambaserve_cache_evictions_total", {"tier": "gpu"})
        gens.append(engine.generate(prompts[2], params(6)))
        sched._drain_inbox(block=False)
        sched.step()
        assert gens[2].req in sched.queues.running
        assert sched.rolling.reclaimed == 1 and len(sched.rolling) == 1
        assert sched.accounting()["held_by_tree"] == 2
        assert engine.metrics.registry.get_sample_value("mambaserve_cache_evictions_total", {"tier": "gpu"}) == evicted
        for _ in range(100):
            sched._drain_inbox(block=False)
            if not (sched.queues.running or sched.inflight):
                break
            sched.step()
        outs = []
        for g in gens:
            ids = []
            async for o in g:
                ids += o.token_ids
            outs.append(ids)
        return outs, sched.accounting()

    outs, acct = asyncio.run(go())
    assert_idle(acct)
    cold = _engine(nemotron, page_size=4, disable_radix_cache=True)

    async def ref():
        return [(await greedy(cold, p, n))[0] for p, n in zip(prompts, (24, 24, 6))]
    assert outs == run_started(cold, ref)
