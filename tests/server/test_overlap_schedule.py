"""Overlap scheduling: step N+1 is launched before step N's tokens are read, and nothing changes but
the timing (same tokens, same logprobs, every slot accounted for)."""

import asyncio

import pytest
import torch

from mambaserve.server.engine.sampling import DeviceSample
from tests.server.conftest import accounting, make_engine, run, serving

GREEDY = {"temperature": 0, "ignore_eos": True}


def _prompt(n, seed):
    return [(seed * 17 + 5 * k * k + 3 * k) % 90 + 3 for k in range(n)]


async def _gen(c, ids, n, session=None, **sp):
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": n, **GREEDY, **sp}}
    if session:
        body["session_params"] = {"id": session}
    r = await c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    b = r.json()
    return b["output_ids"], [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]], \
        b["meta_info"]["finish_reason"]["type"]


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_step_is_launched_before_the_previous_tokens_are_read(tiny_ckpt, monkeypatch, overlap):
    engine = make_engine(tiny_ckpt, disable_overlap_schedule=not overlap)
    log = []
    forward, result = engine.scheduler.runner.forward, DeviceSample.result
    monkeypatch.setattr(engine.scheduler.runner, "forward", lambda b: log.append("launch") or forward(b))
    monkeypatch.setattr(DeviceSample, "result", lambda self: log.append("read") or result(self))

    async def go():
        async with serving(engine) as c:
            return await _gen(c, _prompt(12, 1), 6)

    out, _, _ = run(go())
    assert len(out) == 6
    first = log.index("read")
    steps = log[first - 1:]
    if overlap:
        # prefill, then decode steps: each read comes after the next step's launch
        assert log[first - 2:first] == ["launch", "launch"]
        assert steps[:-1] == ["launch", "read"] * ((len(steps) - 1) // 2)
    else:
        assert steps == ["launch", "read"] * (len(steps) // 2)
    assert log.count("read") >= 6


def test_overlap_changes_nothing_but_timing(tiny_ckpt):
    """Concurrent requests of different lengths, one cut by a stop token mid-batch, seeded sampling,
    resent histories hitting the cache and a streaming session: same outputs with and without overlap."""
    prompts = [_prompt(n, s) for s, n in enumerate((9, 23, 5, 31, 14))]
    lengths = [7, 3, 12, 5, 9]

    async def go(engine, stop_at):
        async with serving(engine) as c:
            first = await asyncio.gather(*[
                _gen(c, p, n, **({"stop_token_ids": [stop_at]} if i == 2 and stop_at else {}),
                     **({"temperature": 0.8, "seed": 11} if i == 4 else {}))
                for i, (p, n) in enumerate(zip(prompts, lengths))])
            resent = await asyncio.gather(*[_gen(c, p + o + _prompt(4, 9), 4)
                                            for p, (o, _, _) in zip(prompts, first)])
            sid = (await c.post("/open_session", json={"streaming": True})).json()
            turns = [await _gen(c, _prompt(6, t), 5, session=sid) for t in range(3)]
            return first, resent, turns, await accounting(engine)

    seq = make_engine(tiny_ckpt, disable_overlap_schedule=True, context_length=512)
    probe = run(go(seq, None))[0][2][0]
    stop_at = probe[4]  # request 2 stops at its 5th token (or earlier) while the others run on
    expected = run(go(seq, stop_at))
    got = run(go(make_engine(tiny_ckpt, context_length=512), stop_at))
    assert expected[0][2][2] == "stop" and len(expected[0][2][0]) <= 5
    for want, have in zip(expected[:3], got[:3]):
        for (wo, wlp, wf), (ho, hlp, hf) in zip(want, have):
            assert (ho, hf) == (wo, wf)
            assert hlp == pytest.approx(wlp, abs=1e-5)
    acc = got[3]  # the open streaming session keeps its live slot
    assert acc["held_by_sessions"] == 1 and acc["running"] == acc["waiting"] == acc["held_by_requests"] == 0
    assert acc["free"] + acc["held_by_tree"] + 1 == acc["capacity"], acc


def test_token_ids_come_from_the_previous_samples_on_the_device():
    """Steady decode (every row continues its own row) takes the previous step's samples as they are; any
    other mapping uploads the host tokens and fills the continuing rows in."""
    from mambaserve.server.engine.batch import ForwardBatch, ForwardMode, StateOps
    from mambaserve.server.engine.model_runner import ModelRunner

    runner = ModelRunner(None, None, torch.device("cpu"))
    prev = torch.tensor([41, 42, 43])

    def batch(tokens, from_prev):
        n = len(tokens)
        return ForwardBatch(ForwardMode.DECODE, tokens, [1] * n, [0] * n, list(range(n)), StateOps(),
                            from_prev=from_prev, prev_tokens=prev)

    steady = runner._token_ids(batch([0, 0, 0], [(0, 0), (1, 1), (2, 2)]))
    assert steady.tolist() == [41, 42, 43] and steady.data_ptr() == prev.data_ptr()  # no copy
    assert runner._token_ids(batch([0, 0], [(0, 0), (1, 1)])).tolist() == [41, 42]  # the last row finished
    assert runner._token_ids(batch([0, 0], [(0, 0), (1, 2)])).tolist() == [41, 43]  # a middle row finished
    assert runner._token_ids(batch([7, 0, 0], [(1, 0), (2, 1)])).tolist() == [7, 41, 42]  # a new row first
