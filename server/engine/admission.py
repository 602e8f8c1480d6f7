"""Which requests run next and with which slots; and the booking of a launched step.

``schedule`` picks the next batch: an EXTEND batch of prefill chunks (admitting waiting requests: a
session's live slot, a cache hit copied into a fresh slot, or a fresh slot) when the policy says so,
else a DECODE batch of every request done prefilling. ``commit`` books a launched step on the host:
everything that does not depend on its sampled tokens (``in_state``, donations of chunk-end states to
the tree, tracked snapshots, requests that end without sampling). Runs on the scheduler thread.
"""

from __future__ import annotations

import collections
import time

from mambaserve.server.cache.pages import PageAllocator
from mambaserve.server.cache.prefix_cache import DisabledCache
from mambaserve.server.cache.radix_tree import TreeNode
from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.engine.metrics import ServerMetrics
from mambaserve.server.engine.output import OutputProcessor
from mambaserve.server.engine.policy import PrefillCandidate, admission_order, next_mode_is_decode, plan_prefill
from mambaserve.server.engine.request import FinishReason, Req, RequestQueues
from mambaserve.server.engine.rolling_snapshots import RollingSnapshots
from mambaserve.server.engine.sampling import Launched
from mambaserve.server.sessions.manager import SessionManager

Plan = list[tuple[Req, int]]  # (request, tokens it runs in the step)
MAX_OVERTAKEN = 4  # admission rounds a waiting request may be passed by others (policy.admission_order)
# Prompt tokens per step of a request that wants the prompt's logprobs: each needs a row of fp32 logits and
# one of log-softmax (2 x 1024 x 50k vocabulary x 4 B = 0.4 GB), where a whole 8k chunk would take 3.3 GB.
PROMPT_LOGITS_PER_STEP = 1024
# Prefill work of at most chunk / SHORT_PREFILL tokens runs before the decoders even right after an EXTEND
# (policy.next_mode_is_decode): a burst of cache hits' new tokens, not a long prompt's next chunk.
SHORT_PREFILL = 4


class Admission:
    def __init__(self, queues: RequestQueues, cache: DisabledCache, sessions: SessionManager,
                 output: OutputProcessor, metrics: ServerMetrics, *, max_running: int, chunk: int,
                 track_interval: int, rolling: RollingSnapshots, pages: PageAllocator | None = None,
                 scan_chunk: int = 1):
        self.queues, self.cache, self.sessions = queues, cache, sessions
        self.rolling = rolling  # hybrids: decode rows' snapshots at page boundaries (their slots are reclaimable)
        # hybrid models' KV pages: a request reserves pages for its prompt + max_new_tokens at admission,
        # so decode never runs out (no retraction); it waits in the queue while they are not free
        self.pages = pages
        self.output, self.metrics = output, metrics
        self.max_running, self.chunk, self.track_interval = max_running, chunk, track_interval
        # the chunk scan's chunks (aligned to absolute positions): a snapshot inside a step is taken in its last one
        self.scan_chunk = scan_chunk
        self.extends_in_a_row = 0  # EXTEND steps since the last DECODE (policy.next_mode_is_decode)

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self, inflight: Launched | None) -> tuple[ForwardBatch | None, Plan]:
        """An EXTEND batch if any prompt has tokens to prefill, else a DECODE batch of every running
        request; the deferred state ops recorded since the last forward ride on whichever runs.
        ``inflight``: the launched step whose samples are still on the device."""
        running, waiting = self.queues.running, self.queues.waiting
        decode = [r for r in running if r.prefill_done]
        short = self.chunk // SHORT_PREFILL
        if next_mode_is_decode(self._prefill_left(short), bool(decode), self.extends_in_a_row, short):
            return self._decode_batch(decode, inflight)
        cands = [PrefillCandidate(r, r.prefill_len - r.in_state, False) for r in running if not r.prefill_done]
        now = time.monotonic()
        groups = collections.Counter(r.group for r in running)
        ready = [(r, max(0, r.prefill_len - r.expected_cached), r.overtaken, groups[r.group]) for r in waiting
                 if (r.session is None or not r.session.awaiting_fold)  # the live state arrives next step
                 and not (self.cache.enabled and _waits_for_its_prompt(r))
                 and not (r.prefetch is not None and r.prefetch.holds(now))]  # its prefix is being read from disk
        new_tokens = {id(r): n for r, n, _, _ in ready}
        cands += [PrefillCandidate(r, new_tokens[id(r)], True, not _has_live_slot(r))
                  for r in admission_order(ready, MAX_OVERTAKEN)]
        # with a host tier, idle sessions' live states can spill there when slots run short (_admit)
        spillable = len(self.sessions.held_slots) if self.cache.host is not None else 0
        slots = self.cache.allocator.num_free + self.cache.evictable_slots + spillable + len(self.rolling)
        plan = plan_prefill(cands, self.chunk, slots, len(running), self.max_running)
        chunks, admitted, arrivals = [], [], list(waiting)
        for req, n in plan:
            if req.slot is None:
                if not self._admit(req):
                    break  # no slot after all (a locked match): wait for one
                admitted.append(req)
            n = min(n, req.prefill_len - req.in_state)  # the real hit, not the estimate, decides
            if req.logits_from is not None:
                n = min(n, PROMPT_LOGITS_PER_STEP)
            if self.pages is not None and self.cache.enabled and n > 0:
                n = self._page_aligned(req, n)
            if n > 0:
                chunks.append((req, n))
        _count_overtaken(arrivals, admitted)
        if chunks:
            return self._extend_batch(chunks), chunks
        return self._decode_batch([r for r in running if r.prefill_done], inflight)

    def _prefill_left(self, cap: int) -> int:
        """Prompt tokens left to prefill (running and waiting requests; a waiting one has at least its last token),
        counted until they pass ``cap``: the policy asks no more, and the queue can hold a thousand."""
        total = 0
        for r in self.queues.running:
            if not r.prefill_done:
                total += r.prefill_len - r.in_state
                if total > cap:
                    return total
        for r in self.queues.waiting:
            total += max(1, r.prefill_len - r.expected_cached)
            if total > cap:
                return total
        return total

    def _decode_batch(self, decode: list[Req], inflight: Launched | None) -> tuple[ForwardBatch | None, Plan]:
        if not decode:
            return None, []
        if self.rolling.enabled:  # (hybrids) state copies at page boundaries: before take_pending below
            self.rolling.record(decode, self._speculative_horizon)
        tokens, from_prev = [], []
        for i, r in enumerate(decode):
            if r.pending is None:
                tokens.append(r.token_at(r.in_state))
            else:  # sampled by the step still running: the device fills it in
                tokens.append(0)
                from_prev.append((i, r.pending[1]))
        batch = ForwardBatch(ForwardMode.DECODE, tokens, [1] * len(decode), [r.in_state for r in decode],
                             [r.slot for r in decode], self.cache.take_pending(), from_prev=from_prev,
                             prev_tokens=inflight.sample.tokens if from_prev else None, pages=self._pages(decode))
        return batch, [(r, 1) for r in decode]

    def _extend_batch(self, chunks: Plan) -> ForwardBatch:
        tokens, lens, starts, slots, track, snap = [], [], [], [], [], []
        at, nxt, owner, top = [], [], [], 0
        for i, (req, n) in enumerate(chunks):
            s = req.in_state
            if req.logits_from is not None:  # prompt logprobs: the logits of every position that predicts one
                for p in range(max(s, req.logits_from), min(s + n, len(req.prompt_ids) - 1)):
                    at.append(len(tokens) + p - s)
                    nxt.append(req.prompt_ids[p + 1])
                    owner.append(i)
                top = max(top, req.top_logprobs_num)
            tokens += req.prompt_ids[s:s + n]
            lens.append(n)
            starts.append(s)
            slots.append(req.slot)
            # The prompt's last chunk samples its first token, and the state before its last token is kept
            # (the same prompt sent again has that token left to run); hybrids': the state at the last page
            # boundary before it. Such a chunk never starts at the last token: a request with only that token
            # left decodes it (Req.prefill_len).
            snap_at = self._snapshot_at(req, s, n)
            if snap_at is not None:
                slot = self.cache.alloc(unused_since=self._speculative_horizon(req), speculative=True)
                if slot is None:  # (hybrids) the snapshot this one goes on from, also while this step copies it
                    slot = self.cache.take_superseded(req.kv, req.locked_node)
                    if slot is not None and isinstance(req.locked_node, TreeNode) and req.locked_node.lock_ref == 0:
                        req.locked_node = None  # its lock went with the slot
                if slot is not None:
                    snap.append((i, slot, snap_at))
            if self.track_interval:
                # strictly inside the chunk (its end is donated whole after the step), not the snapshot's position
                for pos in range((s // self.track_interval + 1) * self.track_interval, s + n, self.track_interval):
                    if pos == snap_at:
                        continue
                    slot = self.cache.alloc(unused_since=self._speculative_horizon(req), speculative=True)
                    if slot is None:
                        break
                    track.append((i, pos, slot))
        return ForwardBatch(ForwardMode.EXTEND, tokens, lens, starts, slots, self.cache.take_pending(), track=track,
                            snap=snap, logprob_at=at, logprob_next=nxt, logprob_owner=owner, logprob_top=top,
                            pages=self._pages([r for r, _ in chunks]))

    def _pages(self, reqs: list[Req]) -> list[list[int]] | None:
        return None if self.pages is None else [self.cache.block_table(r.kv) for r in reqs]

    def _snapshot_at(self, req: Req, s: int, n: int) -> int | None:
        """Where the pass over a prompt's last chunk (``n`` tokens from ``s``) snapshots its state for the tree:
        before the last token (pure Mamba2), a hybrid's last page boundary before it (the tree keeps page-aligned
        states) where the scan takes it in the same pass (in its last chunk, after some of this step's tokens);
        else None (``_page_aligned`` ends a chunk there instead)."""
        last = len(req.prompt_ids) - 1
        if not self.cache.enabled or s + n != last + 1:
            return None
        if self.pages is None:
            # (a streaming session's turn: its next turn goes on from its live state, deeper; a snapshot here
            # would only take a slot, and a host tier's room, from other conversations' states)
            return None if req.session is not None and req.session.streaming else last
        at = last - last % self.pages.page_size
        return at if s < at and at >= last - last % self.scan_chunk else None

    def _page_aligned(self, req: Req, n: int) -> int:
        """Hybrid models with the radix cache: a prefill chunk that leaves the prompt unfinished ends on a
        page boundary (its end state is donated with its pages: the tree keeps page-aligned prefixes
        only), and so does one at the prompt's last page boundary before its last token, so that the same
        prompt sent again (or a chat's next turn) hits there, unless the pass that samples takes that state
        itself (``_snapshot_at``: the page size divides the scan's chunk). A cut would cost one more prefill
        step: a cache hit's whole prefill was two."""
        ps, s = self.pages.page_size, req.in_state
        end = s + n
        if end >= req.prefill_len:
            last = len(req.prompt_ids) - 1
            if last % ps == 0 or self._snapshot_at(req, s, last + 1 - s) is not None:
                return n
            cut = last - last % ps
        else:
            cut = end - end % ps
        return cut - s if cut > s else n

    def _reserved_tokens(self, req: Req) -> int:
        """KV tokens a request may write: its prompt and every token it may sample (the last one runs once
        more when overlap scheduling folds it)."""
        return len(req.prompt_ids) + req.params.max_new_tokens

    def _admit(self, req: Req) -> bool:
        s = req.session
        if s is not None and req.logits_from is not None and s.slot is not None and req.logits_from < s.in_state:
            self.sessions.give_up_live(s)  # its prompt logprobs need positions the live state is past
        if s is not None and s.kv is not None and not self._pages_for(req, lambda: self.cache.extend_kv(
                s.kv, self._reserved_tokens(req))):
            return False  # (hybrids) the live state's KV pages cannot grow to this turn's yet: it waits
        live = self.sessions.take_live_slot(s) if s is not None else None
        if live is not None:  # a streaming session's turn continues from its live state (and its KV pages)
            req.slot, req.in_state, req.kv = live
            req.cached_tokens = req.in_state
            # (a live state read back from storage, --session-persist: its first turn's hit is storage's)
            tier, s.from_storage = "storage" if s.from_storage else "session", False
            self.metrics.observe_lookup(len(req.prompt_ids), req.in_state, tier=tier)
            self._started(req)
            if req.prefill_done and req.params.max_new_tokens == 0:  # one new token, none to generate
                self.output.finish_unsampled(req)
            return True
        # the last token must run to produce logits: never match the whole prompt; and with prompt logprobs
        # the positions they need must run too (a cached state has no logits): the match stops before them
        limit = len(req.prompt_ids) - 1
        if req.logits_from is not None:
            limit = min(limit, req.logits_from)
        cached, node, tier = self.cache.match(req.prompt_ids[:limit])
        if self.pages is not None:
            # hybrid models: the matched prefix's pages are the tree's (read-only); the request's own pages,
            # reserved for what it may write (so decode never runs out), start at the page after it
            req.kv = self._pages_for(req, lambda: self.cache.admit_kv(node, cached, self._reserved_tokens(req)))
            if req.kv is None:
                self.cache.unlock(node)
                return False  # waits for running requests to release pages
        # A hit copies its snapshot into a free slot: the snapshot stays for others. With no slot free,
        # a leaf snapshot only this request reads is taken over (its slot changes hands, no copy) rather
        # than evicting another conversation's snapshot to copy into: this request's own state
        # supersedes it. Only then does the cache evict; and when nothing is free or evictable outside
        # the locked path, any snapshot only this request reads is taken over instead of waiting for a
        # slot only it holds. A miss, or a snapshot others read, waits: the requests holding slots run.
        # A rolling decode snapshot's slot (hybrids) goes before anything is evicted or taken over.
        slot = self.cache.allocator.alloc() if cached else None
        if slot is None and self.cache.allocator.num_free == 0:
            slot = self.rolling.reclaim()
        if slot is None and not (cached and self.cache.sole_reader_of_leaf(node)):
            slot = self.cache.alloc()
            if slot is None and self.cache.host is not None and self.sessions.spill_idle():
                slot = self.cache.alloc()  # an idle session's state went to the tree, evicted down to the host
        moved = slot is None
        if moved:
            self.cache.unlock(node)
            slot = self.cache.take(node)
            if slot is None:
                self.cache.release_kv(req.kv)
                req.kv = None
                return False
        req.slot = slot
        self._started(req)
        if moved:
            req.in_state = req.cached_tokens = cached
        elif cached:
            self.cache.restore(node, slot)  # a copy on the device, or a load from the host tier
            req.in_state = req.cached_tokens = cached
            req.locked_node = node
        elif req.prefill_done:  # a one-token prompt decodes straight from the zero state
            self.cache.clear(slot)
        if self.cache.enabled:  # (--disable-radix-cache: nothing is looked up, so no hit rate of 0 to alert on)
            self.metrics.observe_lookup(len(req.prompt_ids), cached, tier=tier or "gpu",
                                        capacity_miss=self.cache.capacity_miss(req.prompt_ids[:-1], cached))
        if req.prefill_done and req.params.max_new_tokens == 0:  # prompt cached but its last token, nothing to generate
            self.output.finish_unsampled(req)  # (a streaming session's turn folds that token into its live state)
        return True

    def _pages_for(self, req: Req, get):
        """``get()`` (KV pages for ``req``), again after each idle streaming session that gives its live
        state up to the cache while it fails: sessions' pages never starve requests."""
        got = get()
        while not got and self.sessions.spill_idle(exclude=req.session):
            got = get()
        return got

    def _started(self, req: Req) -> None:
        self.queues.start(req)
        if req.prefetch is not None:  # its match (locked while its copy runs) took over from the read's hold
            self.cache.storage.release(req.prefetch)
            req.prefetch = None

    # ---- commit -------------------------------------------------------------------------------------
    def commit(self, batch: ForwardBatch, plan: Plan) -> list[int]:
        """Book a launched step: everything that does not depend on its sampled tokens. Returns the
        plan indices of the rows to sample."""
        self.extends_in_a_row = self.extends_in_a_row + 1 if batch.mode is ForwardMode.EXTEND else 0
        for req in self.queues.running:  # every pending copy ran with this batch: release the snapshots
            self.cache.unlock(req.locked_node)
            req.locked_node = None
        for i, pos, slot in batch.track:
            if not self._keep(plan[i][0], plan[i][0].prompt_ids[:pos], slot):
                self.cache.free(slot)
        for i, slot, *_ in batch.snap:
            tokens = batch.snap_tokens(i, plan[i][0].prompt_ids)
            if not self._keep(plan[i][0], tokens, slot):
                self.cache.free(slot)
            elif self.cache.storage is not None:  # what the same prompt sent again (or after a restart) matches
                self.cache.write_through(tokens, slot)
        rows = []
        for i, (req, n) in enumerate(plan):
            req.in_state += n
            if batch.mode is ForwardMode.EXTEND and req.timeline is not None:
                req.timeline.mark("launched")
            if req.folding:  # its last token is in the state now: hand the slot to the session
                self.output.finish(req, req.finish_reason, emit=False)
                continue
            if batch.mode is ForwardMode.EXTEND:
                if req.in_state < len(req.prompt_ids):
                    if self.cache.enabled:
                        self._donate(req)
                    if req.prefill_done and req.params.max_new_tokens == 0:  # prompt-only: no token to sample
                        self.output.finish_unsampled(req)
                    continue
                if req.params.max_new_tokens == 0:
                    self.output.finish(req, FinishReason.LENGTH)
                    continue
            rows.append(i)
        return rows

    def _speculative_horizon(self, req: Req) -> int:
        """A snapshot made in case it is needed (a chunk end, a tracked position) may displace only other
        such snapshots, unused since before ``req`` and every waiting request arrived: a queued request's
        snapshot was refreshed when it arrived, and others used since belong to live conversations."""
        oldest = self.queues.waiting[0].arrival_tick if self.queues.waiting else req.arrival_tick
        return min(oldest, req.arrival_tick) - 1

    def _keep(self, req: Req, tokens: list[int], slot: int) -> bool:
        """A speculative snapshot of ``req``'s state after ``tokens`` to the tree (hybrids: with its KV pages)."""
        if req.kv is not None:
            return self.cache.keep_kv(req.kv, tokens, slot, speculative=True)
        return self.cache.keep(tokens, slot, speculative=True)

    def _donate(self, req: Req) -> None:
        """Give the request's state to the tree and continue in a fresh slot filled by a deferred copy."""
        if req.kv is not None and req.in_state % self.pages.page_size:
            return  # (hybrids) the tree keeps page-aligned prefixes only
        fresh = self.cache.alloc(unused_since=self._speculative_horizon(req), speculative=True)
        if fresh is None:
            fresh = self.cache.take_superseded(req.kv)  # (hybrids) the snapshot this state goes on from
        if fresh is None:
            return
        if self._keep(req, req.tokens(req.in_state), req.slot):
            if req.prefill_done and self.cache.storage is not None:
                self.cache.write_through(req.tokens(req.in_state), req.slot)  # what a resent prompt matches
            self.cache.copy_into(req.slot, fresh)
            req.slot = fresh
        else:
            self.cache.free(fresh)


def _count_overtaken(arrivals: list[Req], admitted: list[Req]) -> None:
    """Every request still waiting that arrived before one admitted now (``arrivals``: the queue before
    admission) was overtaken once more."""
    if not admitted:
        return
    ids = {id(r) for r in admitted}
    last = max(i for i, r in enumerate(arrivals) if id(r) in ids)
    for r in arrivals[:last]:
        if id(r) not in ids:
            r.overtaken += 1


def _waits_for_its_prompt(req: Req) -> bool:
    """A copy of generate_n waits until the first answer's prefill has put the prompt's state in the cache
    (it then hits it: a snapshot copy instead of a second prefill)."""
    lead = req.follows
    if lead is None or lead.finished or lead.prefill_done:
        req.follows = None  # (and the link to it is dropped: nothing keeps a finished request alive)
        return False
    return True


def _has_live_slot(req: Req) -> bool:
    return req.session is not None and req.session.streaming and req.session.slot is not None
