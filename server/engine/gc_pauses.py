"""The interpreter's garbage collector in a serving process.

A collection stops every thread of the server: the event loop and the scheduler share one interpreter lock.
A full (generation 2) collection walks every container object the process holds, and a started server holds
hundreds of thousands (torch, transformers, the app, compiled kernels): 381k objects and 180 ms a full
collection for the CPU default model on a 2-core machine (and 200-240 ms for a tiny hybrid's server).

``freeze`` runs once the server is ready: what is alive then (nearly all of those objects live as long as the
process) moves to the permanent generation, so later full collections walk only what serving allocated (what
vLLM and SGLang do after start-up). ``watch`` times every collection into ``mambaserve_gc_pause_seconds``.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Callable

log = logging.getLogger(__name__)


def freeze() -> int:
    """Collect once, then exclude every object alive from later collections; returns how many were frozen."""
    began = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("garbage collector: %d objects frozen after a full collection of %.0f ms", frozen,
             1e3 * (time.perf_counter() - began))
    return frozen


def watch(histogram) -> Callable[[], None]:
    """Time each collection of this process into ``histogram`` (labelled by generation); returns the function
    that stops it."""
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            histogram.labels(str(info["generation"])).observe(time.perf_counter() - started[0])

    gc.callbacks.append(callback)
    return lambda: gc.callbacks.remove(callback)
