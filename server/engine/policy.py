"""Which requests run in the next step: pure functions over plain numbers.

A step is an EXTEND batch (prefill chunks, several prompts packed, a long prompt split across steps
by the token budget) or a DECODE batch of every request that is done prefilling. When both kinds
have work they alternate: decoders never starve behind a stream of long prompts, and a request whose
prompt just finished (with a prefix cache its last prompt token runs as a decode step) gets its
first token one short step later instead of after every queued prefill.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def next_mode_is_decode(has_prefill_work: bool, has_decode_work: bool, last_was_extend: bool) -> bool:
    """True: run a DECODE step now; False: try an EXTEND step first."""
    if not has_decode_work:
        return False
    return last_was_extend or not has_prefill_work
