"""The scheduler's outputs reach their event loop once per pass (engine/outbox.py): one wake-up of each loop,
in posting order; posts from another thread go at once; a closed loop's are dropped."""

import asyncio
import threading

from mambaserve.server.engine.outbox import Outbox


def _loop_with_wakeups():
    loop = asyncio.new_event_loop()
    wakeups = []
    call = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: wakeups.append(a) or call(*a)
    return loop, wakeups


def _settle(loop):
    loop.run_until_complete(asyncio.sleep(0.01))


def test_a_passes_outputs_wake_each_loop_once_in_posting_order():
    (a, wa), (b, wb) = _loop_with_wakeups(), _loop_with_wakeups()
    got_a, got_b = [], []
    box = Outbox()
    box.owner = threading.get_ident()
    for k in range(5):
        box.post(a, got_a.append, k)
        box.post(b, got_b.append, -k)
    _settle(a)
    assert got_a == [] and wa == []  # held until the pass ends
    box.flush()
    _settle(a), _settle(b)
    assert got_a == [0, 1, 2, 3, 4] and got_b == [0, -1, -2, -3, -4]
    assert len(wa) == 1 and len(wb) == 1
    box.flush()  # nothing left: no wake-up
    assert len(wa) == 1
    a.close(), b.close()


def test_posts_from_another_thread_go_at_once_and_a_closed_loop_is_skipped():
    loop, wakeups = _loop_with_wakeups()
    got = []
    box = Outbox()  # no owner: the scheduler is not running
    box.post(loop, got.append, "now")
    _settle(loop)
    assert got == ["now"]
    box.owner = threading.get_ident()
    box.post(loop, got.append, "late")
    loop.close()
    box.flush()  # the client's loop is gone: dropped, no error
    other, _ = _loop_with_wakeups()
    box.post(other, got.append, "next")
    box.flush()
    _settle(other)
    assert got == ["now", "next"]
    other.close()
