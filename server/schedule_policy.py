"""Which requests run in the next step: pure functions over plain numbers.

Prefill first (as SGLang does): a step is an EXTEND batch whenever some prompt still has tokens to
prefill and the token budget allows; otherwise it is a DECODE batch of every running request. A
prompt longer than the budget is split across steps (chunked prefill); several short prompts are
packed into one step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillCandidate:
    key: object  # the request (opaque here)
    remaining: int  # prompt tokens not yet prefilled
    needs_slot: bool  # waiting request: admission takes a slot


def plan_prefill(candidates: list[PrefillCandidate], token_budget: int, free_slots: int,
                 running: int, max_running: int) -> list[tuple[object, int]]:
    """Chunks for the next EXTEND step, in candidate order: ``[(key, num_tokens), ...]``.

    Candidates are ordered: requests already prefilling first (they hold slots), then waiting
    requests in arrival order. Admission stops at the first waiting request that cannot get a slot
    or a running place, so arrival order is kept (no small request overtakes a large one forever).
    """
    plan = []
    budget = token_budget
    for c in candidates:
        if budget <= 0:
            break
        if c.needs_slot:
            if free_slots <= 0 or running >= max_running:
                break
            free_slots -= 1
            running += 1
        n = min(c.remaining, budget)
        plan.append((c.key, n))
        budget -= n
    return plan
