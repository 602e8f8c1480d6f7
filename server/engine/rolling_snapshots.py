"""Hybrid models' decode-time snapshots: a copy of each decoding request's state at the last page boundary
it crossed, so a chat's next turn hits past the previous answer (docs/design.md §5).

The radix tree of a hybrid keeps states on page boundaries only (they go in with the KV pages of their
tokens), and a request's final state lands on one only 1 time in ``page_size``. So while a request
decodes, the state in its slot is copied into one extra slot of its own (the *rolling* slot) whenever it
covers a page multiple of tokens past the prompt (the prompt's own boundaries are the prefill's
snapshots already). At the request's end the rolling slot goes to the tree with the KV pages of its
tokens when the final state does not end on a page, else it is freed.

Ordering: the copy is recorded into the cache's pending ops while the decode batch is built, before
``take_pending`` hands them to that batch, so on the device it runs after every step launched before
(the state then covers exactly ``in_state`` tokens: the host books ``in_state`` at launch) and before the
forward that feeds the token at that position. Overlap scheduling changes nothing: the token a row reads
from the step still running (``from_prev``) is that forward's input, not the state's. Decode CUDA graphs
neither: state ops run eagerly before the graph replays.

Speculative: a rolling slot is allocated as a prompt's snapshot is (``Admission._speculative_horizon``):
a free slot, else the least recently used snapshot unused since before the request and every waiting
one arrived is evicted for it (speculative ones first); on a warmed server the tree holds every slot, so
a free-list-only rolling slot would never be taken. Admission takes it back (``reclaim``) before it
evicts anything or makes a request wait. Streaming sessions keep
their live state between turns and take none. Pure Mamba2 models (every position is a key), hybrids
at page size 1 and the plain engine take none either: ``enabled`` is False and the decode path does no work.
"""

from __future__ import annotations

from typing import Callable

from mambaserve.server.cache.prefix_cache import DisabledCache
from mambaserve.server.engine.request import Req


class RollingSnapshots:
    def __init__(self, cache: DisabledCache, page_size: int):
        self.cache = cache
        self.page_size = page_size
        # (a page of one token puts every final state on a page: nothing to roll)
        self.enabled = cache.enabled and cache.pages is not None and page_size > 1
        self.holders: list[Req] = []  # requests holding a rolling slot, in the order they took it
        self.skipped = 0  # boundaries not copied for want of a slot (tests read it)
        self.reclaimed = 0  # rolling slots admission took back

    def __len__(self) -> int:
        return len(self.holders)

    def slots(self) -> list[int]:
        return [r.rolling[0] for r in self.holders]

    def record(self, decode: list[Req], horizon: Callable[[Req], int]) -> None:
        """Before a decode batch takes the pending ops: each row whose state covers a page multiple of
        tokens past its prompt gets it copied into its rolling slot (allocated once, evicting only
        snapshots unused since ``horizon(row)``)."""
        ps = self.page_size
        for r in decode:
            n = r.in_state
            if n % ps or n < len(r.prompt_ids) or (r.session is not None and r.session.streaming):
                continue
            if r.rolling is None:
                slot = self.cache.alloc(unused_since=horizon(r), speculative=True)
                if slot is None:
                    self.skipped += 1
                    continue
                self.holders.append(r)
            else:
                slot = r.rolling[0]
            self.cache.copy_into(r.slot, slot)
            r.rolling = (slot, n)

    def reclaim(self) -> int | None:
        """A rolling slot taken back for a request that needs one (the newest holder's: the least answer
        lost); None if none is held. Its last copy was launched already: anything the new owner records
        runs after it."""
        if not self.holders:
            return None
        r = self.holders.pop()
        slot, r.rolling = r.rolling[0], None
        self.reclaimed += 1
        return slot

    def end(self, req: Req, keep: bool) -> None:
        """``req`` ended (its final state kept or freed already, its KV hold not released yet): with ``keep``
        and a final state not on a page, the rolling snapshot goes to the tree with its tokens' KV; else,
        or if the tree has that prefix already, its slot is freed."""
        if req.rolling is None:
            return
        self.holders.remove(req)
        (slot, n), req.rolling = req.rolling, None
        ps = self.page_size
        if not (keep and req.kv is not None and req.in_state % ps and self.cache.keep_kv(req.kv, req.tokens(n), slot)):
            self.cache.free(slot)

    def check(self, running: list[Req]) -> None:
        """Only running, non-streaming requests hold rolling slots, each covering a page multiple of tokens
        its state has passed."""
        ids = {id(r) for r in running}
        assert all(id(r) in ids for r in self.holders), "a rolling slot held by a request that ended"
        assert len(self.holders) == sum(r.rolling is not None for r in running), "a rolling slot not booked"
        for r in self.holders:
            slot, n = r.rolling
            assert n % self.page_size == 0 and len(r.prompt_ids) <= n <= r.in_state, (r.rid, n, r.in_state)
            assert r.session is None or not r.session.streaming, "a streaming session's turn holds a rolling slot"
