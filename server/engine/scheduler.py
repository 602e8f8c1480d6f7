"""The scheduler thread: owns the queues, the state slots, the sessions and every request's lifecycle.

One step reads like the engine it drives: drain the inbox (new requests, aborts, calls) → schedule a
batch (``admission``) → launch the model → commit the step on the host → read the *previous* step's
sampled tokens while the device runs this one (``output``; overlap scheduling). Nothing else touches
its data; other threads talk to it through ``submit``, ``abort`` and ``call`` (a function run between
steps, returning a Future).

Overlap rests on one rule: the host books a step completely when it launches it (``commit``):
``in_state`` counts the tokens of every launched step, slots change hands, snapshots enter the tree.
That is safe because the device runs state copies, clears and forwards in launch order. Only the
sampled tokens arrive a step late; a decode step that needs one reads it on the device
(``ForwardBatch.from_prev``). A request that turns out finished has run one extra step, which folds
its last token into its state.

Progress guarantee: whenever nothing runs, the head of the queue is admitted (or refused) in the next
step. Nothing running means no snapshot is locked, so every slot is free, an evictable snapshot, or
held by an idle streaming session; sessions may hold only a bounded share of the pool
(``--session-slot-fraction`` < 1), and a hit whose only evictable slots lie on its own matched path
takes that snapshot's slot over instead of waiting. ``check_invariants`` asserts it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from mambaserve.server.cache.host_tier import HostTier
from mambaserve.server.cache.prefix_cache import DisabledCache, PrefixCache
from mambaserve.server.cache.radix_tree import CacheBusyError
from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.admission import Admission
from mambaserve.server.engine.metrics import ServerMetrics
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.outbox import Outbox
from mambaserve.server.engine.output import OutputProcessor
from mambaserve.server.engine.policy import burst_hold
from mambaserve.server.engine.request import BadRequest, FinishReason, Req, RequestQueues, fit_to_context
from mambaserve.server.engine.rolling_snapshots import RollingSnapshots
from mambaserve.server.engine.sampling import Launched, Sampler
from mambaserve.server.engine.session_files import SessionFiles
from mambaserve.server.engine.timeline import Arrivals
from mambaserve.server.engine.tiering import Prefetcher, SessionPersistence, build_storage_tier
from mambaserve.server.sessions.manager import SessionManager
from mambaserve.server.sessions.table import SessionError, SessionTable

log = logging.getLogger(__name__)

CALLS_BUDGET_S = 0.002  # the scheduler's time for control calls between two steps while requests run
# A held step looks again at least this often: a request refused at the HTTP edge leaves the arriving count
# without posting anything to the inbox.
HOLD_POLL_S = 0.0005


def session_slot_limit(fraction: float, capacity: int) -> int:
    """Slots idle streaming sessions may hold: a share of the pool, always leaving one for requests."""
    return max(0, min(capacity - 1, int(fraction * capacity)))


class Scheduler:
    def __init__(self, cfg: ServerConfig, runner: ModelRunner, metrics: ServerMetrics, *, max_running: int,
                 context_length: int, track_interval: int = 0, storage_compat: dict | None = None,
                 arrivals: Arrivals | None = None):
        self.runner, self.metrics = runner, metrics
        self.arrivals = arrivals or Arrivals()  # requests the HTTP edge has received, not yet submitted
        self.hold_s, self.quiet_s = cfg.burst_hold_ms / 1e3, cfg.burst_quiet_ms / 1e3
        self._hold_started: float | None = None  # when the step being held was first held
        # requests submitted since the server was last idle, and in the busy time before (the burst to expect)
        self._busy_requests, self._last_busy_requests = 0, 0
        self._last_submitted = 0.0  # when the scheduler last took a request
        self.slots = runner.pool.allocator
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.calls: collections.deque = collections.deque()  # (fn, future) taken from the inbox, not run yet
        self.outbox = Outbox()  # requests' outputs, handed to their event loops once per pass of the loop
        page_size = cfg.page_size or 1
        host = HostTier(runner.host_pool.capacity, page_size) if runner.host_pool is not None else None
        # hybrid models: KV pages, reserved per request at admission and released at its end (the page-aligned
        # prefix of what it wrote goes to the radix tree)
        self.pages = runner.kv_pool.allocator if runner.kv_pool is not None else None
        self.cache = (DisabledCache(self.slots, self.pages) if cfg.disable_radix_cache
                      else PrefixCache(self.slots, page_size, host=host, pages=self.pages))
        self.storage = None  # the storage tier (engine/tiering.py), with --storage-dir
        if cfg.storage_dir is not None and host is not None:
            self.storage = build_storage_tier(cfg, runner, host, metrics, storage_compat or {},
                                              lambda result: self.inbox.put(("storage", result)))
            self.cache.attach(self.storage)
        persist = cfg.session_persist and self.storage is not None
        table = SessionTable(cfg.max_sessions, cfg.session_timeout, cfg.max_session_timeout,
                             cfg.sessions_per_client, cfg.require_session_secret)
        self.sessions = SessionManager(table,
                                       session_slot_limit(cfg.session_slot_fraction, self.slots.capacity),
                                       self._free_session_state, self._keep_or_free,
                                       lambda reason: metrics.sessions_closed.labels(reason).inc(),
                                       self.storage.forget_session if persist else lambda sid: None)
        self.session_files = SessionFiles(self.sessions, self.cache, runner, metrics, states=self.pages is None)
        self.queues = RequestQueues()
        self.sampler = Sampler(runner.device, cfg.seed)
        self.rolling = RollingSnapshots(self.cache, page_size)
        self.output = OutputProcessor(self.queues, self.cache, self.sessions, self.sampler, metrics, context_length,
                                      self.rolling, pages=self.pages)
        self.prefetcher = Prefetcher(self.storage, self.cache, self.queues) if self.storage is not None else None
        self.persistence = None
        if persist:
            self.persistence = SessionPersistence(self.storage, self.cache, self.sessions, metrics, storage_compat or {},
                                                  runner.model.dims.vocab_size, context_length, runner)
            self.output.persist_turn = self.persistence.persist_turn
        self.admission = Admission(self.queues, self.cache, self.sessions, self.output, metrics,
                                   max_running=max_running, chunk=cfg.chunked_prefill_size,
                                   track_interval=0 if cfg.disable_radix_cache else track_interval,
                                   rolling=self.rolling, pages=self.pages, scan_chunk=runner.scan_chunk)
        self.max_running = max_running
        self.context_length = context_length
        self.overlap = not cfg.disable_overlap_schedule
        self.debug_invariants = cfg.debug_cache_invariants
        self.request_timeout = cfg.request_timeout
        self.inflight: Launched | None = None
        self.steps = 0
        self.stalled_steps = 0  # consecutive steps that ran nothing while requests waited and none ran
        self.lost: str | None = None  # capacity a failed step left that could not be reclaimed (/health says it)
        # Liveness (progress()): when the step now running began (None between steps), and when one last ended.
        self.step_started: float | None = None
        self.last_step_ended = time.monotonic()
        self._next_reap = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        metrics.observe_cache_config(page_size=page_size, num_pages=self.pages.capacity if self.pages else 0,
                                     num_state_slots=self.slots.capacity,
                                     track_interval=0 if cfg.disable_radix_cache else track_interval)
        metrics.host_slots_total.set(host.allocator.capacity if host is not None else 0)
        per = runner.slot_bytes
        metrics.tier_capacity_bytes.labels("gpu").set(self.slots.capacity * per)
        metrics.tier_capacity_bytes.labels("host").set(host.allocator.capacity * per if host is not None else 0)

    # ---- thread-safe API -------------------------------------------------------------------------
    def start(self) -> None:
        if self.alive:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current step; queued and running requests stay and resume on start()."""
        self._stop.set()
        self.inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, req: Req) -> None:
        self.inbox.put(("add", req))

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put(("call", (fn, fut)))
        return fut

    # ---- the loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        self.outbox.owner = threading.get_ident()
        try:
            self._run()
        finally:
            self.outbox.owner = None
            self.outbox.flush()

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.queues.running or self.inflight
            # requests held for their prefix from storage only: wait for the read (it posts to the inbox)
            self._drain_inbox(block=not (busy or self.queues.waiting) or (not busy and self._all_held()),
                              timeout=0.01 if self.queues.waiting else 0.5)
            self.outbox.flush()  # refusals, calls' answers
            if self._hold():
                continue
            self.step_started = time.monotonic()
            try:
                self.step()
            except Exception:  # a failed step must not take the server down
                log.exception("step failed; failing its requests")
                self.inflight = None
                self.output.fail_running("internal error; the server log has the details")
                self._reclaim()
            finally:
                self.outbox.flush()
                self.step_started, self.last_step_ended = None, time.monotonic()
        if self.inflight is not None:  # stopping: read the last launched step's tokens
            self.output.read(self.inflight)
            self.inflight = None
        if self.storage is not None:  # stopping: the writes recorded so far reach the disk
            if self.cache.pending.on_done:
                self.runner.apply_state_ops(self.cache.take_pending())
            self.storage.drain()

    def step(self) -> None:
        self._reap()
        if self.storage is not None:
            self.cache.write_back()
            if self.prefetcher.wanting:
                self.prefetcher.retry()
        batch, plan = self.admission.schedule(self.inflight)
        launched = None
        if batch is not None:
            self._count_moves(batch.state_ops)
            out = self.runner.forward(batch)  # launched; the device runs it while the host goes on
            if log.isEnabledFor(logging.DEBUG):  # (when each request's tokens ran: with the timelines' lines)
                log.debug("step %d launched at %.1fms: %s, %d rows, %d tokens, %.2fms after the step began",
                          self.steps, 1e3 * time.monotonic(), batch.mode.name, batch.batch_size, batch.num_tokens,
                          1e3 * (time.monotonic() - self.step_started))
            if out.input_logprobs is not None:  # (waits for this step: only requests that ask for them)
                self.output.add_input_logprobs(plan, batch.logprob_owner, out.input_logprobs)
            rows = self.admission.commit(batch, plan)
            if rows:
                reqs = [plan[i][0] for i in rows]
                if self.inflight is not None and any(r.pending is not None and r.constraint is not None
                                                     and r.constraint.follows_output for r in reqs):
                    # a grammar's (or bad words') mask needs the token of the step before: read it now, while
                    # the device runs this step's forward, then sample
                    self.output.read(self.inflight)
                    self.inflight = None
                launched = self.sampler.launch(out.logits, rows, reqs)
            self.steps += 1
        elif self.cache.pending.on_done:  # storage writes wait for their offloads: issue them now
            self.runner.apply_state_ops(self.cache.take_pending())
        idle = batch is None and self.inflight is None and not self.queues.running
        self.stalled_steps = self.stalled_steps + 1 if idle and self.queues.waiting and not self._all_held() else 0
        prev, self.inflight = self.inflight, launched
        if prev is not None:  # the device is busy with this step meanwhile
            self.output.read(prev)
        if not self.overlap and self.inflight is not None:
            self.output.read(self.inflight)
            self.inflight = None
        self._update_gauges()
        if self.debug_invariants:
            self.check_invariants()

    def _hold(self) -> bool:
        """Hold an idle server's next step while requests are still arriving (``policy.burst_hold``): wait a
        little for the inbox and return True, for the loop to look again; False: step now."""
        now = time.monotonic()
        held = 0.0 if self._hold_started is None else now - self._hold_started
        left = burst_hold(self._idle(), len(self.queues.waiting), self.arrivals.pending, held, self.hold_s,
                          self.quiet_s - (now - self._last_submitted), self._last_busy_requests)
        if left <= 0:
            if self._hold_started is not None:
                self.metrics.burst_hold.observe(held)
                self._hold_started = None
            return False
        if self._hold_started is None:
            self._hold_started = now
        self._drain_inbox(block=True, timeout=min(left, HOLD_POLL_S))
        return True

    def _idle(self) -> bool:
        """Nothing running, and nothing in flight but a step that only folds finished requests' last tokens into
        their states (the next request must not wait for it, nor be taken for part of a busy time)."""
        return not self.queues.running and (self.inflight is None or all(r.finished for r in self.inflight.rows))

    def _all_held(self) -> bool:
        return self.prefetcher is not None and self.prefetcher.all_held()

    def _drain_inbox(self, block: bool, timeout: float = 0.5) -> None:
        block = block and not self.calls  # (calls left over from the step before run now)
        try:
            item = self.inbox.get(timeout=timeout) if block else self.inbox.get_nowait()
        except queue.Empty:
            item = None
        while item is not None:
            kind, arg = item
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "storage":
                try:
                    self.storage.apply(arg)
                except Exception:  # a bad entry or record must not stop the scheduler thread
                    log.exception("applying a storage result failed")
            elif kind == "call":
                self.calls.append(arg)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                item = None
        self._run_calls()

    def _run_calls(self) -> None:
        """Control calls (sessions, accounting, flush, a snapshot's state copy): while requests run, at most
        CALLS_BUDGET_S of them per step (at least one), the rest after the next step, so that a burst of
        them never holds decoding up; all of them otherwise."""
        start = time.monotonic()
        while self.calls:
            fn, fut = self.calls.popleft()
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)
            if self.queues.running and time.monotonic() - start >= CALLS_BUDGET_S:
                return

    def _add(self, req: Req) -> None:
        if req.rid in self.queues.by_rid:
            self.output.refuse(req, BadRequest(f"a request with id {req.rid!r} is already running",
                                               code="duplicate_request_id", status=409))
            return
        try:
            self.sampler.seed(req)
        except Exception as e:  # this request's own values: it alone fails
            log.exception("request %s refused: its sampler could not be seeded", req.rid)
            self.output.refuse(req, BadRequest(f"invalid sampling parameters: {e}"))
            return
        if req.session_id is not None:
            tp, opened = req.turn_params, False
            try:
                if tp.open is not None:  # a turn that opens its session (behind a router: no /open_session)
                    self.sessions.open(req.session_id, tp.open.streaming, tp.open.timeout, tp.open.capacity,
                                       tp.caller)
                    opened = True
                prompt = self.sessions.turn_prompt(req.session_id, req.prompt_ids, tp)
                req.params = fit_to_context(len(prompt), req.params, self.context_length, False,
                                            f"session {req.session_id!r} history + this turn")
                room = self.sessions.room(req.session_id, len(prompt))
                if room is not None and req.params.max_new_tokens > room:  # the capacity caps answers too
                    req.params = dataclasses.replace(req.params, max_new_tokens=room)
                req.session = self.sessions.begin_turn(req.session_id, req.rid, tp, prompt)
            except (SessionError, BadRequest) as e:
                if (isinstance(e, SessionError) and e.code == "session_not_found" and self.persistence is not None
                        and not opened and self.persistence.look_up(req, self._add)):
                    return  # persisted by an earlier run or another pod? taken again once looked up
                if opened:  # a refused first turn leaves no session behind
                    self.sessions.close(req.session_id, "error")
                self.sampler.forget(req.rid)
                self.output.refuse(req, e)
                return
            if tp.close:  # deferred: released when this turn ends
                self.sessions.close(req.session_id)
            req.prompt_ids = prompt
        # its snapshot is needed soon: refreshed now, eviction takes older ones first while it waits (a
        # match never covers the last token: it must run to produce logits)
        if self.prefetcher is None:
            req.expected_cached = self.cache.touch(req.prompt_ids[:-1])
        else:  # a prefix found on storage only is read into the host tier while the request waits
            req.expected_cached = self.prefetcher.on_arrival(req)
        if req.logits_from is not None:  # (admission's match stops there: see Admission._admit)
            req.expected_cached = min(req.expected_cached, req.logits_from)
        req.arrival_tick = self.cache.clock
        if self._idle() and not self.queues.waiting:  # the first of a busy time
            self._last_busy_requests, self._busy_requests = self._busy_requests, 0
        self._busy_requests += 1
        self._last_submitted = time.monotonic()
        self.queues.add(req)
        if req.timeline is not None:
            req.timeline.mark("queued")
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))

    def _abort(self, rid: str) -> None:
        req = self.queues.by_rid.get(rid)
        if req is not None and req.folding:
            self.output.finish(req, req.finish_reason, emit=False)  # answered already; the fold is skipped
        elif req is not None and not req.finished:
            self.output.finish(req, FinishReason.ABORT)

    def _keep_or_free(self, tokens: list[int], slot: int, kv=None) -> None:
        """A state nobody holds any more: a snapshot in the cache if it takes it, else a free slot. Hybrids:
        with its KV pages (``kv``) where it ends on a page; its other pages are freed, the tree's unpinned."""
        if kv is None:
            if not self.cache.keep(tokens, slot):
                self.cache.free(slot)
            return
        if len(tokens) % self.pages.page_size or not self.cache.keep_kv(kv, tokens, slot):
            self.cache.free(slot)
        self.cache.release_kv(kv)

    def _free_session_state(self, slot: int, kv=None) -> None:
        """A closed session's live state: its slot freed; hybrids: its own pages freed, the tree's unpinned."""
        self.cache.free(slot)
        self.cache.release_kv(kv)

    def _reap(self) -> None:
        """Twice a second: close idle sessions past their timeout, end requests past --request-timeout."""
        now = time.monotonic()
        if now < self._next_reap:
            return
        self._next_reap = now + 0.5
        self.sessions.reap(now)
        if self.request_timeout:
            for req in [*self.queues.waiting, *self.queues.running]:
                if now - req.created > self.request_timeout and not req.finished:
                    self.output.finish(req, FinishReason.ABORT, error_code="request_timeout",
                                       error=f"the request ran past the server's timeout of {self.request_timeout:g} s")

    def _reclaim(self) -> None:
        """After a failed step, its requests failed: what it had taken and not booked yet (a prefill's snapshot
        slot, KV pages of a request that never started) goes back to the free lists, and the accounting is
        checked. What still does not add up is ``lost``: /health reports it until a restart."""
        running, sessions = self.queues.running, self.sessions.table.sessions.values()
        owned = {r.slot for r in running} | set(self.rolling.slots()) | set(self.sessions.held_slots)
        if self.cache.enabled:
            owned |= set(self.cache.tree.all_slots())
        slots = sorted(self.slots.used_slots() - owned)
        for slot in slots:
            self.cache.free(slot)
        pages = 0
        if self.pages is not None:
            holds = {id(r.kv) for r in running} | {id(s.kv) for s in sessions}
            for hold in [h for h in self.pages.owners() if id(h) not in holds]:
                pages += len(self.pages.pages(hold))
                self.cache.release_kv(hold)
        if slots or pages:
            log.warning("after the failed step: %d state slots and %d KV pages nobody held returned", len(slots), pages)
            self.metrics.reclaimed.labels("state_slots").inc(len(slots))
            self.metrics.reclaimed.labels("kv_pages").inc(pages)
        try:
            self.check_invariants()
        except AssertionError as e:
            self.lost = f"the accounting does not add up after a failed step ({e}); restart the server"
            log.error("%s", self.lost)

    # ---- bookkeeping --------------------------------------------------------------------------------
    def _count_moves(self, ops) -> None:
        for kind, a, _ in ops.ops:
            if kind in ("offload", "load"):
                self.metrics.tier_bytes.labels("gpu_to_host" if kind == "offload" else "host_to_gpu").inc(
                    self.runner.slot_bytes)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self.queues.running))
        m.waiting.set(len(self.queues.waiting))
        pages = self.pages
        # (a rolling decode snapshot's slot is admission's for the asking: as good as evictable)
        m.observe_pools(slots_used=self.slots.num_used, slots_evictable=self.cache.evictable_slots + len(self.rolling),
                        slots_total=self.slots.capacity, pages_used=pages.num_used if pages else 0,
                        pages_evictable=self.cache.evictable_pages() if pages else 0,
                        pages_total=pages.capacity if pages else 0)
        m.sessions_open.set(len(self.sessions.table.sessions))
        m.session_held_slots.set(len(self.sessions.held_slots))
        if self.cache.evictions:
            m.evictions.labels("gpu").inc(self.cache.evictions)
            self.cache.evictions = 0
        host, per = self.cache.host, self.runner.slot_bytes
        m.tier_used_bytes.labels("gpu").set(self.cache.tree_slots * per)
        if host is not None:
            m.host_slots_used.set(host.allocator.num_used)
            m.tier_used_bytes.labels("host").set(host.allocator.num_used * per)
            if host.evictions:  # (counted with or without a storage tier below)
                m.evictions.labels("host").inc(host.evictions)
                host.evictions = 0
        if self.storage is not None:
            self.storage.update_gauges()

    def check_invariants(self) -> None:
        """free + held by requests + by the tree + by sessions == capacity; no slot shared or leaked."""
        running, waiting = self.queues.running, self.queues.waiting
        held = [r.slot for r in running] + self.rolling.slots() + self.sessions.held_slots
        assert None not in held, "running request without a slot"
        assert len(set(held)) == len(held), "two requests share a slot"
        tree = set(self.cache.tree.all_slots()) if self.cache.enabled else set()
        assert not tree & set(held), f"slots held by both a request and the tree: {tree & set(held)}"
        assert tree | set(held) == self.slots.used_slots(), f"slot leak: {self.slots.used_slots() - tree - set(held)}"
        assert self.slots.num_free + len(held) + len(tree) == self.slots.capacity, "slot accounting broken"
        assert all(r.slot is None for r in waiting), "waiting request holds a slot"
        assert all(r.locked_node is None for r in running), "a snapshot stayed locked after its copy"
        assert all(s.in_flight in self.queues.by_rid for s in self.sessions.table.sessions.values() if s.in_flight), \
            "a session waits for a turn that no longer exists"
        assert self.stalled_steps <= 1, f"requests wait while nothing runs ({self.stalled_steps} steps): admission is stuck"
        self.rolling.check(running)
        self.cache.check_invariants()
        if self.pages is not None:
            self._check_pages(running)

    def _check_pages(self, running: list[Req]) -> None:
        """Every KV page is free, owned by exactly one running request or idle streaming session, or owned by
        the radix tree; a request or session reads the tree's pages only on the path it holds pinned."""
        self.pages.check(self.cache.tree_pages())
        sessions = [s for s in self.sessions.table.sessions.values() if s.kv is not None]
        holds = [(r.rid, r.kv) for r in running] + [(s.id, s.kv) for s in sessions]
        written = [(r.rid, r.kv, r.in_state) for r in running] + [(s.id, s.kv, s.in_state) for s in sessions]
        for who, h, n in written:
            assert h is None or len(self.cache.block_table(h)) * self.pages.page_size >= n, \
                f"{who} wrote {n} tokens of KV, past the {len(self.cache.block_table(h))} pages it holds"
        assert all(s.slot is not None for s in sessions), "a session holds KV pages without its live state"
        assert not [s for s in self.sessions.table.sessions.values() if s.slot is not None and s.kv is None], \
            "a session holds a live state without its KV pages"
        ids = {id(h) for _, h in holds}
        assert len(ids) == len(holds), "two requests or sessions share a KV hold"
        assert {id(o) for o in self.pages.owners()} <= ids, "KV pages held by a request or session that ended"
        for who, h in holds:
            assert h is not None, f"running request {who} without its KV pages"
            if h.node is not None:  # a page-aligned prefix of the tree's, pinned
                assert h.prefix == self.cache.tree.pages_to(h.node) and h.node.kv_ref > 0, \
                    f"{who} reads tree pages it does not hold"
            else:
                assert not h.prefix, f"{who} reads tree pages without a pinned node"

    def accounting(self) -> dict:
        q = self.queues
        host = self.cache.host
        st = self.storage
        return {"capacity": self.slots.capacity, "free": self.slots.num_free,
                "held_by_requests": len(q.running) + len(self.rolling),  # (hybrids: their rolling decode snapshots)
                "host_capacity": host.allocator.capacity if host else 0, "held_by_host": host.allocator.num_used if host else 0,
                "storage_entries": len(st.entries) if st else 0, "storage_bytes": st.used if st else 0,
                "storage_capacity_bytes": st.capacity if st else 0, "storage_degraded": int(bool(st and not st.writable)),
                "storage_read_only": int(bool(st and st.readable and not st.writable)),
                "held_by_tree": self.cache.tree_slots, "held_by_sessions": len(self.sessions.held_slots),
                "evictable": self.cache.evictable_slots, "running": len(q.running), "waiting": len(q.waiting),
                "sessions": len(self.sessions.table.sessions), "rolling_snapshots": len(self.rolling),
                **({"kv_pages": self.pages.capacity, "kv_pages_free": self.pages.num_free,
                    "kv_pages_tree": len(self.cache.tree_pages()), "kv_pages_evictable": self.cache.evictable_pages()}
                   if self.pages else {})}

    def load(self) -> dict:
        """Requests running and waiting, and the tokens (prompt + output so far) they hold: what
        sglang-router's load monitor reads (``/get_load``; policy ``power_of_two`` compares ``num_tokens``)."""
        q = self.queues
        return {"num_reqs": len(q.running), "num_waiting_reqs": len(q.waiting),
                "num_tokens": sum(r.num_tokens for r in (*q.running, *q.waiting))}

    def progress(self) -> dict:
        """Read from any thread (plain attribute reads): how long the step now running has run, how long ago
        one last ended, the batches run, and the requests waiting on the scheduler. A wedged device or a stuck
        step shows as a step that keeps running while requests are pending; an idle scheduler ends a step at
        least every half second (the inbox wait's timeout)."""
        now, started = time.monotonic(), self.step_started
        return {"steps": self.steps, "step_running_seconds": None if started is None else now - started,
                "last_step_seconds_ago": now - self.last_step_ended,
                "pending_requests": len(self.queues.running) + len(self.queues.waiting)}

    def flush_cache(self) -> int:
        """Empty the radix cache; refused while requests run (their snapshots may be in use)."""
        if self.queues.running or self.queues.waiting:
            raise CacheBusyError(f"cannot flush the cache while {len(self.queues.running)} requests run and "
                                 f"{len(self.queues.waiting)} wait")
        return self.cache.flush()

    def persist_sessions(self, then: Callable[[int, list[str]], None]) -> None:
        """Drain: ``then(written, ids not on storage)`` once the sessions behind are written (``SessionPersistence
        .persist_open``); without --session-persist none is, and every open session is listed."""
        if self.persistence is None:
            then(0, list(self.sessions.table.sessions))
            return
        self.runner.apply_state_ops(self.cache.take_pending())  # a deferred copy into a session's slot runs first
        self.persistence.persist_open(then)
