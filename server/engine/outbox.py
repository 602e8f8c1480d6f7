"""Outputs on their way from the scheduler thread to the event loops of their requests, delivered once per step.

``loop.call_soon_threadsafe`` wakes the loop with a write to its self-pipe, and that system call lets the
interpreter lock go: the event loop (busy answering other requests) can take it, and the scheduler waits to get
it back, up to the switch interval (5 ms). One call per request and token made that a step's every row; the
outbox gathers a step's outputs and hands each loop all of its own with one call (``flush``, at the end of each
of the scheduler's passes). Posts from any other thread (the scheduler not running yet, or stopped) go at once.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


def _deliver(items: list[tuple[Callable, object]]) -> None:
    for fn, arg in items:
        fn(arg)


class Outbox:
    def __init__(self) -> None:
        self.owner: int | None = None  # the thread whose posts wait for flush (the scheduler's, while it runs)
        self._items: dict[object, list[tuple[Callable, object]]] = {}  # by event loop, in posting order

    def post(self, loop, fn: Callable, arg) -> None:
        """``fn(arg)`` on ``loop``: with the next flush if posted from the owner thread, else now."""
        if threading.get_ident() != self.owner:
            loop.call_soon_threadsafe(fn, arg)
            return
        self._items.setdefault(loop, []).append((fn, arg))

    def flush(self) -> None:
        items, self._items = self._items, {}
        for loop, group in items.items():
            try:
                loop.call_soon_threadsafe(_deliver, group)
            except RuntimeError:  # its loop has closed: nobody is left to read these
                if not loop.is_closed():
                    raise
                log.debug("dropped %d outputs for a closed event loop", len(group))
