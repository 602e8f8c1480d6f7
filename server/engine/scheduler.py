"""The scheduler thread: owns the queues, the state slots and every request's lifecycle.

Its loop reads like the engine it drives: take new requests and aborts from the inbox, schedule a
batch, launch the model, then read the *previous* step's sampled tokens while the device runs this
one (overlap scheduling). Nothing else touches its data; other threads talk to it through ``submit``,
``abort`` and ``call`` (a function run between steps, returning a Future).

Overlap rests on one rule: the host books a step completely when it launches it (``commit``):
``in_state`` counts the tokens of every launched step, slots change hands, snapshots enter the tree.
That is safe because the device runs state copies, clears and forwards in launch order. Only the
sampled tokens arrive a step late; a decode step that needs one reads it on the device
(``ForwardBatch.from_prev``). A request that turns out finished has run one extra step, which folds
its last token into its state.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.engine.metrics import ServerMetrics
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.cache.prefix_cache import DisabledCache, PrefixCache
from mambaserve.server.cache.radix_tree import CacheBusyError
from mambaserve.server.sessions.manager import SessionManager
from mambaserve.server.sessions.table import SessionError, SessionTable
from mambaserve.server.engine.request import FinishReason, Req, StepOutput
from mambaserve.server.engine.sampling import DeviceSample, sample, to_device
from mambaserve.server.engine.policy import PrefillCandidate, next_mode_is_decode, plan_prefill

log = logging.getLogger(__name__)


@dataclass
class Launched:
    """A launched step whose sampled tokens the host has not read yet."""

    rows: list[Req]  # the request of each sampled row
    sample: DeviceSample


class Scheduler:
    def __init__(self, runner: ModelRunner, metrics: ServerMetrics, *, max_running: int, chunked_prefill_size: int,
                 context_length: int, seed: int = 0, overlap: bool = True, debug_invariants: bool = False,
                 radix_cache: bool = True, page_size: int = 1, track_interval: int = 0, max_sessions: int = 1024,
                 session_timeout: float = 600.0, snapshot_dir: Path | None = None, compat: dict | None = None):
        self.runner = runner
        self.slots = runner.pool.allocator
        self.cache = PrefixCache(self.slots, page_size) if radix_cache else DisabledCache(self.slots)
        self.track_interval = track_interval if radix_cache else 0
        self.sessions = SessionManager(SessionTable(max_sessions, session_timeout), self.cache, runner.pool, metrics,
                                       snapshot_dir or Path("mambaserve-sessions"), compat or {},
                                       self._apply_pending_now)
        self._next_reap = 0.0
        self.metrics = metrics
        self.max_running = max_running
        self.chunk = chunked_prefill_size
        self.context_length = context_length
        self.debug_invariants = debug_invariants
        self.device = runner.device
        self.default_gen = torch.Generator(device=self.device).manual_seed(seed)
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.steps = 0
        self.last_was_extend = False
        self.inflight: Launched | None = None
        self.overlap = overlap
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        metrics.slots_total.set(self.slots.capacity)

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
        while not self._stop.is_set():
            self._drain_inbox(block=not (self.waiting or self.running or self.inflight))
            try:
                self.step()
            except Exception as e:  # a failed step must not take the server down
                log.exception("step failed; failing its requests")
                self._fail_running(f"internal error: {e}")
        if self.inflight is not None:  # stopping: read the last launched step's tokens
            self._read_tokens(self.inflight)
            self.inflight = None

    def step(self) -> None:
        now = time.monotonic()
        if now >= self._next_reap:  # idle sessions are closed within a second of their timeout
            self.sessions.reap(now)
            self._next_reap = now + 0.5
        batch, plan = self.schedule()
        launched = None
        if batch is not None:
            self.last_was_extend = batch.mode is ForwardMode.EXTEND
            out = self.runner.forward(batch)
            rows = self.commit(batch, plan)
            if rows:
                launched = self._sample(out.logits, rows, [plan[i][0] for i in rows])
            self.steps += 1
        prev, self.inflight = self.inflight, launched
        if prev is not None:  # the device is busy with this step meanwhile
            self._read_tokens(prev)
        if not self.overlap and self.inflight is not None:
            self._read_tokens(self.inflight)
            self.inflight = None
        self._update_gauges()
        if self.debug_invariants:
            self.check_invariants()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = item
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "call":
                fn, fut = arg
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, req: Req) -> None:
        if req.rid in self.reqs:
            req.emit(self._output(req, [], "", finish=FinishReason.ABORT, error=f"duplicate request id {req.rid!r}"))
            return
        if req.session_id is not None:
            try:
                self.sessions.begin_turn(req, req.session_id, req.turn_params, self.context_length)
            except SessionError as e:
                req.finish_reason = FinishReason.ABORT
                out = self._output(req, [], "", finish=FinishReason.ABORT, error=str(e))
                out.error_status, out.error_code = e.status, e.code
                req.emit(out)
                return
        # With a cache, the prompt's last token runs as the first decode step, so that the state after
        # the prompt minus that token exists and can be kept: the same prompt sent again then hits.
        req.prefill_len = len(req.prompt_ids) - (1 if self.cache.enabled else 0)
        self.reqs[req.rid] = req
        self.waiting.append(req)
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))

    def _abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is not None and req.folding:
            self._finish(req, req.finish_reason, emit=False)  # answered already; the fold is skipped
        elif req is not None and not req.finished:
            self._finish(req, FinishReason.ABORT)

    # ---- scheduling ---------------------------------------------------------------------------------
    def schedule(self) -> tuple[ForwardBatch | None, list[tuple[Req, int]]]:
        """An EXTEND batch if any prompt has tokens to prefill, else a DECODE batch of every running
        request; the deferred state ops recorded since the last forward ride on whichever runs."""
        decode = [r for r in self.running if r.prefill_done]
        has_prefill = bool(self.waiting) or len(decode) < len(self.running)
        if next_mode_is_decode(has_prefill, bool(decode), self.last_was_extend):
            return self._decode_batch(decode)
        cands = [PrefillCandidate(r, r.prefill_len - r.in_state, False) for r in self.running if not r.prefill_done]
        cands += [PrefillCandidate(r, r.prefill_len, True, not self._has_live_slot(r)) for r in self.waiting
                  if r.session is None or not r.session.awaiting_fold]  # the live state arrives next step
        plan = plan_prefill(cands, self.chunk, self.slots.num_free + self.cache.evictable_slots,
                            len(self.running), self.max_running)
        chunks = []
        for req, n in plan:
            if req.slot is None and not self._admit(req):
                break  # no slot after all (a locked match): wait for one
            n = min(n, req.prefill_len - req.in_state)  # a cache hit shortens the prefill
            if n > 0:
                chunks.append((req, n))
        if chunks:
            return self._extend_batch(chunks), chunks
        return self._decode_batch([r for r in self.running if r.prefill_done])

    def _decode_batch(self, decode: list[Req]) -> tuple[ForwardBatch | None, list[tuple[Req, int]]]:
        if not decode:
            return None, []
        tokens, from_prev = [], []
        for i, r in enumerate(decode):
            if r.pending is None:
                tokens.append(r.token_at(r.in_state))
            else:  # sampled by the step still running: the device fills it in
                tokens.append(0)
                from_prev.append((i, r.pending[1]))
        batch = ForwardBatch(ForwardMode.DECODE, tokens, [1] * len(decode), [r.in_state for r in decode],
                             [r.slot for r in decode], self.cache.take_pending(), from_prev=from_prev,
                             prev_tokens=self.inflight.sample.tokens if from_prev else None)
        return batch, [(r, 1) for r in decode]

    def _extend_batch(self, chunks: list[tuple[Req, int]]) -> ForwardBatch:
        tokens, lens, starts, slots, track = [], [], [], [], []
        for i, (req, n) in enumerate(chunks):
            s = req.in_state
            tokens += req.prompt_ids[s:s + n]
            lens.append(n)
            starts.append(s)
            slots.append(req.slot)
            if self.track_interval:
                # strictly inside the chunk: its end is donated whole after the step
                for pos in range((s // self.track_interval + 1) * self.track_interval, s + n, self.track_interval):
                    slot = self.cache.alloc()
                    if slot is None:
                        break
                    track.append((i, pos, slot))
        return ForwardBatch(ForwardMode.EXTEND, tokens, lens, starts, slots, self.cache.take_pending(), track=track)

    @staticmethod
    def _has_live_slot(req: Req) -> bool:
        return req.session is not None and req.session.streaming and req.session.slot is not None

    def _admit(self, req: Req) -> bool:
        if self.sessions.take_live_slot(req):
            self.waiting.remove(req)
            self.running.append(req)
            self._seed(req)
            return True
        # the last token must run to produce logits: never match the whole prompt
        cached, node, src = self.cache.match(req.prompt_ids[:min(req.prefill_len, len(req.prompt_ids) - 1)])
        slot = self.cache.alloc()
        if slot is None:
            self.cache.unlock(node)
            return False
        self.waiting.remove(req)
        req.slot = slot
        self.running.append(req)
        if cached:
            self.cache.pending.copies.append((src, slot))
            req.in_state = req.cached_tokens = cached
            req.locked_node = node
        elif req.prefill_len == 0:  # a one-token prompt decodes straight from the zero state
            self.cache.pending.clears.append(slot)
        self.metrics.observe_lookup(len(req.prompt_ids), cached)
        self._seed(req)
        if req.prefill_done and req.params.max_new_tokens == 0:
            self._finish(req, FinishReason.LENGTH)  # prompt fully cached and nothing to generate
        return True

    def _seed(self, req: Req) -> None:
        if req.params.seed is not None:
            self.generators[req.rid] = torch.Generator(device=self.device).manual_seed(req.params.seed)

    def _donate(self, req: Req) -> None:
        """Give the request's state to the tree and continue in a fresh slot filled by a deferred copy."""
        fresh = self.cache.alloc()
        if fresh is None:
            return
        if self.cache.keep(req.tokens(req.in_state), req.slot):
            self.cache.pending.copies.append((req.slot, fresh))
            req.slot = fresh
        else:
            self.cache.free(fresh)

    # ---- results ------------------------------------------------------------------------------------
    def commit(self, batch: ForwardBatch, plan: list[tuple[Req, int]]) -> list[int]:
        """Book a launched step: everything that does not depend on its sampled tokens. Returns the
        plan indices of the rows to sample."""
        for req in self.running:  # every pending copy ran with this batch: release the snapshots
            self.cache.unlock(req.locked_node)
            req.locked_node = None
        for i, pos, slot in batch.track:
            if not self.cache.keep(plan[i][0].prompt_ids[:pos], slot):
                self.cache.free(slot)
        rows = []
        for i, (req, n) in enumerate(plan):
            req.in_state += n
            if req.folding:  # its last token is in the state now: hand the slot to the session
                self._finish(req, req.finish_reason, emit=False)
                continue
            if batch.mode is ForwardMode.EXTEND:
                if req.in_state < len(req.prompt_ids):
                    if self.cache.enabled:
                        self._donate(req)
                    if req.prefill_done and req.params.max_new_tokens == 0:
                        self._finish(req, FinishReason.LENGTH)  # prompt-only request: no token to sample
                    continue
                if req.params.max_new_tokens == 0:
                    self._finish(req, FinishReason.LENGTH)
                    continue
            rows.append(i)
        return rows

    def _sample(self, logits: torch.Tensor, rows: list[int], reqs: list[Req]) -> Launched:
        """Sample ``logits[rows]`` (one row per sequence of the step) for ``reqs``, without waiting."""
        if len(rows) < logits.shape[0]:
            logits = logits.index_select(0, to_device(rows, torch.long, logits.device))
        result = sample(logits, [r.params for r in reqs], [self.generators.get(r.rid, self.default_gen) for r in reqs],
                        [j for j, r in enumerate(reqs) if r.return_logprob],
                        [r.top_logprobs_num if r.return_logprob else 0 for r in reqs])
        launched = Launched(reqs, result)
        for j, req in enumerate(reqs):
            req.pending = (launched, j)
        return launched

    def _read_tokens(self, launched: Launched) -> None:
        result = launched.sample.result()
        for j, req in enumerate(launched.rows):
            if req.pending is not None and req.pending[0] is launched:  # not yet sampled again by a newer step
                req.pending = None
            if req.finished:  # aborted, or finished by the token before (this row folded it in)
                continue
            lp = result.logprobs[j] if result.logprobs is not None else None
            top = result.top_logprobs[j] if result.top_logprobs is not None else None
            self._append_token(req, result.tokens[j], lp, top)

    def _append_token(self, req: Req, tok: int, lp: float | None, top) -> None:
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.created)
        else:
            self.metrics.itl.observe(now - req.last_token_time)
        req.last_token_time = now
        req.output_ids.append(tok)
        self.metrics.generation_tokens.inc()
        if req.return_logprob:
            req.logprobs.append(lp)
            req.top_logprobs.append(top or [])
        finish = None
        if tok in req.stop_token_ids:
            finish, req.matched_stop = FinishReason.STOP, tok
        else:
            req.detokenizer.add(tok)
            if req.detokenizer.stopped is not None:
                finish, req.matched_stop = FinishReason.STOP, req.detokenizer.stopped
        if finish is None and (len(req.output_ids) >= req.params.max_new_tokens
                               or req.num_tokens >= self.context_length):
            finish = FinishReason.LENGTH
        if finish is not None and req.in_state < req.num_tokens and self._keeps_live_state(req):
            # Answer now; run the last token once more before the session takes the slot, so the next
            # turn prefills only its new tokens. (Usually the step launched meanwhile already runs it.)
            req.finish_reason, req.folding = finish, True
            self.sessions.turn_answered(req)
            self._emit_final(req, finish)
        elif finish is not None:
            self._finish(req, finish)
        else:
            if req.stream:
                req.emit(self._output(req, req.output_ids[req.sent_tokens:], req.detokenizer.release()))
                req.sent_tokens = len(req.output_ids)

    @staticmethod
    def _keeps_live_state(req: Req) -> bool:
        s = req.session
        return s is not None and s.streaming and not s.closing

    def _emit_final(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        req.emit(self._output(req, req.output_ids[req.sent_tokens:], req.detokenizer.release(final=True),
                              finish=reason, error=error))
        req.sent_tokens = len(req.output_ids)

    def _output(self, req: Req, token_ids, text, finish=None, error=None) -> StepOutput:
        start = req.sent_tokens
        return StepOutput(
            rid=req.rid, token_ids=list(token_ids), text=text,
            logprobs=req.logprobs[start:] if req.return_logprob else None,
            top_logprobs=req.top_logprobs[start:] if req.return_logprob else None,
            prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens, finish_reason=finish, matched_stop=req.matched_stop, error=error)

    def _finish(self, req: Req, reason: FinishReason, error: str | None = None, emit: bool = True) -> None:
        req.finish_reason = reason
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.cache.unlock(req.locked_node)
        req.locked_node = None
        if req.session is not None:
            completed = (req.folding or reason is not FinishReason.ABORT) and not error
            if self.sessions.end_turn(req, completed):
                req.slot = None  # the session holds it until the next turn
        if req.slot is not None:
            # the state covers in_state tokens of prompt + output: the next turn starts there
            if error or not self.cache.keep(req.tokens(req.in_state), req.slot):
                self.cache.free(req.slot)
            req.slot = None
        self.reqs.pop(req.rid, None)
        self.generators.pop(req.rid, None)
        self.metrics.requests.labels("error" if error else reason.value).inc()
        self.metrics.e2e.observe(time.monotonic() - req.created)
        if emit:
            self._emit_final(req, reason, error)

    def _fail_running(self, message: str) -> None:
        self.inflight = None
        for req in list(self.running):
            self._finish(req, FinishReason.ABORT, error=message)

    # ---- bookkeeping --------------------------------------------------------------------------------
    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self.running))
        m.waiting.set(len(self.waiting))
        m.slots_used.set(self.slots.num_used)
        m.slots_evictable.set(self.cache.evictable_slots)
        m.sessions_open.set(len(self.sessions.table.sessions))
        m.session_held_slots.set(len(self.sessions.held_slots))
        if self.cache.evictions:
            m.evictions.labels("gpu").inc(self.cache.evictions)
            self.cache.evictions = 0

    def check_invariants(self) -> None:
        """free + held by requests + by the tree + by sessions == capacity; no slot shared or leaked."""
        held = [r.slot for r in self.running] + self.sessions.held_slots
        assert None not in held, "running request without a slot"
        assert len(set(held)) == len(held), "two requests share a slot"
        tree = set(self.cache.tree.all_slots()) if self.cache.enabled else set()
        assert not tree & set(held), f"slots held by both a request and the tree: {tree & set(held)}"
        assert tree | set(held) == self.slots.used_slots(), f"slot leak: {self.slots.used_slots() - tree - set(held)}"
        assert self.slots.num_free + len(held) + len(tree) == self.slots.capacity, "slot accounting broken"
        assert all(r.slot is None for r in self.waiting), "waiting request holds a slot"
        assert all(r.locked_node is None for r in self.running), "a snapshot stayed locked after its copy"
        assert all(s.in_flight in self.reqs for s in self.sessions.table.sessions.values() if s.in_flight), \
            "a session waits for a turn that no longer exists"
        self.cache.check_invariants()

    def accounting(self) -> dict:
        return {"capacity": self.slots.capacity, "free": self.slots.num_free, "held_by_requests": len(self.running),
                "held_by_tree": self.cache.tree_slots, "held_by_sessions": len(self.sessions.held_slots),
                "evictable": self.cache.evictable_slots, "running": len(self.running), "waiting": len(self.waiting),
                "sessions": len(self.sessions.table.sessions)}

    def _apply_pending_now(self) -> None:
        ops = self.cache.take_pending()
        if ops:
            self.runner.apply_state_ops(ops)

    def flush_cache(self) -> int:
        """Empty the radix cache; refused while requests run (their snapshots may be in use)."""
        if self.running or self.waiting:
            raise CacheBusyError(f"cannot flush the cache while {len(self.running)} requests run and "
                                 f"{len(self.waiting)} wait")
        return self.cache.flush()
