"""Where a request's time to first token goes: one timestamp per stage, from arrival to the first byte.

The HTTP edge opens a ``Timeline`` per generation request (``api.timing``) and makes it current for the
handler's context; ``Engine.generate`` attaches the current one to the requests it submits, and the
scheduler thread marks the engine's stages. When the first byte of the answer is written the edge
observes each stage's share, ``mambaserve_request_stage_seconds{stage}``: the time from the stage
before it to this one, so the shares of a request add up to its time to first byte.

  received     the HTTP request arrived (before its body was read)
  validated    body parsed, prompt tokenized and checked: submitted to the scheduler
  queued       the scheduler thread took it from its inbox
  admitted     it got a state slot (a cache hit's snapshot copy recorded)
  launched     the first forward pass that runs its tokens was launched
  first_token  its first sampled token was read on the host
  finished     its last token was read (non-streamed answers: written only then)
  first_byte   the first byte of the answer went to the socket
"""

from __future__ import annotations

import contextvars
import logging
import time

log = logging.getLogger(__name__)

STAGES = ("received", "validated", "queued", "admitted", "launched", "first_token", "finished", "first_byte")
_ORDER = {s: i for i, s in enumerate(STAGES)}


class Timeline:
    __slots__ = ("marks", "arrivals")

    def __init__(self, received: float | None = None):
        self.marks = {"received": time.monotonic() if received is None else received}
        self.arrivals: Arrivals | None = None  # counted there until validated (or answered without it)

    def mark(self, stage: str) -> None:
        """Stamp ``stage`` now, once: requests sharing a timeline (n > 1, batched prompts) keep the first."""
        if stage not in self.marks:
            self.marks[stage] = time.monotonic()
            if stage == "validated":
                self.settle()

    def settle(self) -> None:
        """No longer on its way to the scheduler: submitted, refused, or its connection gone."""
        if self.arrivals is not None:
            self.arrivals.pending -= 1
            self.arrivals = None

    def shares(self) -> list[tuple[str, float]]:
        """(stage, seconds since the stage before it), in the order the stages happened."""
        seq = sorted(self.marks.items(), key=lambda kv: (kv[1], _ORDER[kv[0]]))
        return [(stage, t - prev) for (stage, t), (_, prev) in zip(seq[1:], seq)]


class Arrivals:
    """Generation requests the HTTP edge has received (their headers) and not yet submitted to the scheduler nor
    answered otherwise. An idle scheduler holds its next step a moment while some are on their way
    (``policy.burst_hold``), so that a client's burst runs as one prefill step. Written by the event loop only;
    the scheduler thread reads ``pending``."""

    __slots__ = ("pending",)

    def __init__(self):
        self.pending = 0

    def arrived(self) -> Timeline:
        """The timeline of a request whose headers just arrived, counted until it settles."""
        tl = Timeline()
        tl.arrivals = self
        self.pending += 1
        return tl


current: contextvars.ContextVar[Timeline | None] = contextvars.ContextVar("mambaserve_timeline", default=None)


def observe(timeline: Timeline, histogram, rid: str = "") -> None:
    """Export a request's stage shares (only one that ran: a refused request has no first token)."""
    if "first_token" not in timeline.marks:
        return
    shares = timeline.shares()
    for stage, seconds in shares:
        histogram.labels(stage).observe(seconds)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("request %s received at %.1fms, to first byte: %s", rid, 1e3 * timeline.marks["received"],
                  " ".join(f"{s} {1e3 * t:.2f}ms" for s, t in shares))
