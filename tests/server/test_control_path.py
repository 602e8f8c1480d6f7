"""Control calls stay off the decode path: session files are written and read on the snapshot store's thread
(a disk that hangs holds up no stream), and calls queued on the scheduler get a bounded slice between steps."""

import asyncio
import threading
import time

import pytest

from mambaserve.server.engine.request import SamplingParams
from tests.server.conftest import accounting, assert_idle, make_engine, run_started

LONG = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_ckpt, tmp_path_factory):
    return make_engine(tiny_ckpt, session_snapshot_dir=str(tmp_path_factory.mktemp("snaps")))


async def _stream_counting(engine, counter: list[int]):
    async for out in engine.generate([3, 4, 5], LONG):
        counter[0] += len(out.token_ids)


async def _session(engine, sid: str) -> None:
    await engine.open_session(sid, True, None, None)
    async for _ in engine.generate([7, 8], SamplingParams(max_new_tokens=2, temperature=0), session_id=sid):
        pass


def test_a_snapshot_or_restore_whose_disk_hangs_holds_up_no_stream(engine):
    """The store's thread is held (a disk that does not answer) while a snapshot and a restore are asked
    for: a stream beside them keeps decoding, and both complete once the disk answers."""
    gate = threading.Event()

    async def go():
        await _session(engine, "kept")
        saved = await engine.snapshot_session("kept", "kept-file")
        await _session(engine, "other")
        counter = [0]
        stream = asyncio.ensure_future(_stream_counting(engine, counter))
        while counter[0] < 5:
            await asyncio.sleep(0.005)
        engine.snapshots.run(gate.wait)  # every file job after this waits
        snap = asyncio.ensure_future(engine.snapshot_session("other", "other-file"))
        restore = asyncio.ensure_future(engine.restore_session("kept-file", "kept-again"))
        before = counter[0]
        while counter[0] < before + 40 and not stream.done():
            await asyncio.sleep(0.005)
        decoded_while_held = counter[0] - before
        pending = not snap.done() and not restore.done()
        gate.set()
        results = await snap, await restore
        await stream
        for sid in ("kept", "other", "kept-again"):
            await engine.close_session(sid)
        return saved, decoded_while_held, pending, results, await accounting(engine)

    try:
        saved, decoded, pending, (snap, restore), acc = run_started(engine, go)
    finally:
        gate.set()
    assert saved["has_state"]
    assert pending and decoded >= 40
    assert snap["name"] == "other-file" and snap["has_state"]
    assert restore == {"session_id": "kept-again", "tokens": saved["tokens"], "has_state": True}
    assert_idle(acc)


def test_queued_control_calls_take_a_bounded_slice_between_steps(engine):
    """Eight calls queued at once, each longer than the slice, while a stream decodes: one runs per step (before,
    all of them ran before the next step)."""
    async def go():
        counter = [0]
        stream = asyncio.ensure_future(_stream_counting(engine, counter))
        while counter[0] < 5:
            await asyncio.sleep(0.005)

        def slow_call():
            time.sleep(0.004)  # (CALLS_BUDGET_S is 2 ms)
            return engine.scheduler.steps
        steps = await asyncio.gather(*(engine.run_in_scheduler(slow_call) for _ in range(8)))
        await stream
        return steps, await accounting(engine)

    steps, acc = run_started(engine, go)
    assert len(set(steps)) == 8 and steps == sorted(steps), steps
    assert_idle(acc)
