"""Which requests run in the next step: pure functions over plain numbers.

A step is an EXTEND batch (prefill chunks, several prompts packed, a long prompt split across steps
by the token budget) or a DECODE batch of every request that is done prefilling. When both kinds
have work they alternate (a short prefill may take one more step first): decoders never starve behind a
stream of long prompts, and a request whose prompt just finished gets its second token one short step later
instead of after every queued prefill.
"""

from __future__ import annotations

from dataclasses import dataclass


def burst_hold(idle: bool, waiting: int, arriving: int, held: float, limit: float, quiet_left: float = 0.0,
               expected: int = 0) -> float:
    """Seconds an idle scheduler waits (at most; it looks again as requests come in) before launching a step
    for its ``waiting`` requests, having held ``held`` so far, up to ``limit`` in all: while others are still
    ``arriving`` at the HTTP edge; and, while fewer are waiting than the ``expected`` many the last burst brought,
    for ``quiet_left`` more (what is left of a quiet period after the last submission: a client's burst leaves it
    over a millisecond or two, and its later requests may not have reached the edge when the first is submitted).
    A burst then runs as one prefill step, which reads the weights once (every expert of a MoE model), instead
    of as one step for its first arrivals and another for the rest, which the device runs after the first.
    0: launch now (busy, nothing to run, nothing on its way, or as many as expected)."""
    if not idle or not waiting:
        return 0.0
    if arriving > 0:
        return max(0.0, limit - held)
    if waiting < expected:
        return max(0.0, min(quiet_left, limit - held))
    return 0.0


@dataclass(frozen=True)
class PrefillCandidate:
    key: object  # the request (opaque here)
    remaining: int  # prompt tokens not yet prefilled
    waiting: bool  # not admitted yet: admission takes a running place
    needs_slot: bool = True  # ... and a free slot (not a session turn that brings its own)


def plan_prefill(candidates: list[PrefillCandidate], token_budget: int, free_slots: int,
                 running: int, max_running: int) -> list[tuple[object, int]]:
    """Chunks for the next EXTEND step, in candidate order: ``[(key, num_tokens), ...]``.

    Candidates are ordered: requests already prefilling first (they hold slots), then waiting
    requests in ``admission_order``. Admission stops at the first waiting request that cannot get a
    slot or a running place, so that order is kept (no request overtakes one that aged).
    """
    plan = []
    budget = token_budget
    for c in candidates:
        if budget <= 0:
            break
        if c.waiting:
            if running >= max_running or (c.needs_slot and free_slots <= 0):
                break
            free_slots -= c.needs_slot
            running += 1
        n = min(c.remaining, budget)
        plan.append((c.key, n))
        budget -= n
    return plan


def admission_order(waiting: list[tuple[object, int, int, int]], max_overtaken: int) -> list[object]:
    """Waiting requests ``(key, new tokens to prefill, times overtaken, running places its group holds)`` (in
    arrival order) in the order they are offered admission: first those overtaken ``max_overtaken`` times
    already, in arrival order; then the others by fewest running places of their group (the choices of one
    request with ``n`` > 1 are a group: they take turns with newer requests instead of holding admission
    until all of them ran), then fewest new tokens (a cache hit's short prefill before a long cold one),
    arrival order among equals. A request waits behind others at most ``max_overtaken`` rounds."""
    aged = [key for key, _, n, _ in waiting if n >= max_overtaken]
    rest = sorted((w for w in waiting if w[2] < max_overtaken), key=lambda w: (w[3], w[1]))  # stable: arrivals
    return aged + [key for key, _, _, _ in rest]


def next_mode_is_decode(prefill_tokens: int, has_decode_work: bool, extends_in_a_row: int, short: int) -> bool:
    """True: run a DECODE step now; False: try an EXTEND step first. ``prefill_tokens``: the prompt tokens
    left to prefill (running and waiting requests); ``extends_in_a_row``: EXTEND steps since the last DECODE.

    After one EXTEND, a second runs before the decoders if what is left to prefill is ``short`` or less: cache
    hits that arrive a little apart (a burst through HTTP lands over a few steps) each run a few dozen new
    tokens, and making them wait behind a decode step cost them more than their whole prefill. Never a third:
    decoders wait at most two steps."""
    if not has_decode_work:
        return False
    if prefill_tokens == 0 or extends_in_a_row >= 2:
        return True
    return extends_in_a_row == 1 and prefill_tokens > short
