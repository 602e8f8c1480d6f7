"""After a step: its sampled tokens appended to their requests, stop checks, increments to the clients,
and the end of a request (its slot to the tree, the free list or its session).

Runs on the scheduler thread. ``read`` takes a launched step's tokens one step late (overlap
scheduling: the device runs the next step meanwhile); ``finish`` is every request's one way out.
"""

from __future__ import annotations

import logging
import time

from mambaserve.server.cache.pages import PageAllocator
from mambaserve.server.cache.prefix_cache import DisabledCache
from mambaserve.server.engine.metrics import ServerMetrics
from mambaserve.server.engine.request import FinishReason, Req, RequestQueues, StepOutput
from mambaserve.server.engine.rolling_snapshots import RollingSnapshots
from mambaserve.server.engine.sampling import NON_FINITE_SAMPLING, Launched, Sampler
from mambaserve.server.sessions.manager import SessionManager

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, queues: RequestQueues, cache: DisabledCache, sessions: SessionManager, sampler: Sampler,
                 metrics: ServerMetrics, context_length: int, rolling: RollingSnapshots,
                 pages: PageAllocator | None = None):
        self.queues, self.cache, self.sessions, self.sampler = queues, cache, sessions, sampler
        self.pages = pages  # hybrid models' KV pages: a request's are released when it ends
        self.rolling = rolling  # hybrids: decode-time snapshots at page boundaries, to the tree at the end
        self.metrics = metrics
        self.context_length = context_length
        # --session-persist: called with a session's turn that completed and a function answering it, which it
        # calls once the turn is on storage (returns False if it writes nothing: the turn is answered at once)
        self.persist_turn = None

    def read(self, launched: Launched) -> None:
        """Append a launched step's tokens (waits only for that step's host copies)."""
        result = launched.sample.result()
        for j, req in enumerate(launched.rows):
            if req.pending is not None and req.pending[0] is launched:  # not yet sampled again by a newer step
                req.pending = None
            if req.finished:  # aborted, or finished by the token before (this row folded it in)
                continue
            if result.tokens[j] < 0:  # no distribution to sample from: this request alone fails
                self._fail_non_finite(req, result.tokens[j])
                continue
            lp = result.logprobs[j] if result.logprobs is not None else None
            top = result.top_logprobs[j] if result.top_logprobs is not None else None
            self._observe_token(req)
            self._after_token(req, self._append(req, result.tokens[j], lp, top))

    def _fail_non_finite(self, req: Req, status: int) -> None:
        """A row whose logits (the model's, or after this request's penalties and filters) were not finite.
        Only this request ends; its state is freed, not cached (it may be what produced them)."""
        if status == NON_FINITE_SAMPLING:
            log.warning("request %s: its sampling parameters left no finite distribution; it fails alone", req.rid)
            self.metrics.non_finite.labels("sampling").inc()
            self.finish(req, FinishReason.ABORT, error_code="invalid_sampling_params", error_status=400,
                        error="this request's sampling parameters (temperature, top_p, min_p, penalties) left no "
                              "finite distribution to sample from")
        else:
            log.error("request %s: the model's logits were not finite (its state or input); it fails alone", req.rid)
            self.metrics.non_finite.labels("logits").inc()
            self.finish(req, FinishReason.ABORT, error="the model produced non-finite logits for this request")

    def _observe_token(self, req: Req) -> None:
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            if req.timeline is not None:
                req.timeline.mark("first_token")
            self.metrics.ttft.observe(now - req.created)
        else:
            self.metrics.itl.observe(now - req.last_token_time)
        req.last_token_time = now
        self.metrics.generation_tokens.inc()

    @staticmethod
    def _append(req: Req, tok: int, lp: float | None, top) -> FinishReason | None:
        """Add one sampled token; STOP if it is a stop token or completes a stop string."""
        req.output_ids.append(tok)
        if req.return_logprob:
            req.logprobs.append(lp)
            req.top_logprobs.append(top or [])
        if tok in req.stop_token_ids:
            req.matched_stop = tok
            if req.params.include_stop_str_in_output:
                req.detokenizer.add(tok)
            return FinishReason.STOP
        req.detokenizer.add(tok)
        if req.detokenizer.stopped is not None:
            req.matched_stop = req.detokenizer.stopped
            return FinishReason.STOP
        if req.constraint is not None and req.constraint.accept(tok):  # its grammar is complete
            return FinishReason.STOP
        return None

    def _after_token(self, req: Req, finish: FinishReason | None) -> None:
        if finish is None and (len(req.output_ids) >= req.params.max_new_tokens
                               or req.num_tokens >= self.context_length):
            finish = FinishReason.LENGTH
        if finish is None:
            if req.stream:
                self._emit(req, self._output(req, req.output_ids[req.sent_tokens:], req.detokenizer.release()))
        elif req.in_state < req.num_tokens and self._keeps_live_state(req):
            # Answer now; run the last token once more before the session takes the slot, so the next
            # turn prefills only its new tokens. (Usually the step launched meanwhile already runs it.)
            req.finish_reason, req.folding = finish, True
            self.sessions.turn_answered(req.session, req.rid, req.prompt_ids + req.output_ids)
            if self.persist_turn is None:  # (persisted: answered once its state is on storage, by finish)
                self._emit_final(req, finish)
        else:
            self.finish(req, finish)

    def finish_unsampled(self, req: Req) -> None:
        """A request with nothing to generate (``max_new_tokens`` 0) whose state covers its prompt but the
        last token: it ends now; a streaming session's turn first folds that token into its live state."""
        self._after_token(req, FinishReason.LENGTH)

    @staticmethod
    def _keeps_live_state(req: Req) -> bool:
        s = req.session
        return s is not None and s.streaming and not s.closing

    # ---- the way out --------------------------------------------------------------------------------
    def finish(self, req: Req, reason: FinishReason, error: str | None = None, emit: bool = True,
               error_code: str | None = None, error_status: int | None = None) -> None:
        """End ``req``: its slot goes to its session, the tree (at what its state covers) or the free list.
        ``error``/``error_code``: why it ended early (the client sees both); ``error_status``: the HTTP status
        a response not started yet gets (the client's own fault: 4xx; else the API's default)."""
        req.finish_reason = reason
        if req.prefetch is not None:  # ended while waiting for its prefix from storage
            self.cache.storage.release(req.prefetch)
            req.prefetch = None
        self.queues.remove(req)
        self.cache.unlock(req.locked_node)
        req.locked_node = None
        persist = False
        if req.session is not None:
            completed = (req.folding or reason is not FinishReason.ABORT) and not error
            persist = completed and self.persist_turn is not None and not req.session.closing
            if self.sessions.end_turn(req.session, req.rid, req.prompt_ids + req.output_ids, completed,
                                      req.slot, req.in_state, req.kv):
                if req.kv is not None:  # (hybrids) the pages it reserved and did not write are freed
                    self.cache.trim_kv(req.kv, req.in_state)
                req.slot = req.kv = None  # the session holds them until the next turn
        if req.slot is not None:
            # the state covers in_state tokens of prompt + output: the next turn starts there
            if error or not self._keep(req):
                self.cache.free(req.slot)
            req.slot = None
        if req.rolling is not None:  # (hybrids) its last page boundary, kept where the final state is not on one
            self.rolling.end(req, keep=not error)
        if req.kv is not None:  # its own pages freed, the tree's unpinned
            self.cache.release_kv(req.kv)
            req.kv = None
        self.sampler.forget(req.rid)
        self.metrics.requests.labels("error" if error else reason.value).inc()
        self.metrics.e2e.observe(time.monotonic() - req.created)
        # --session-persist: a session's turn is answered once it is on storage (a folded turn's answer waited)
        if emit or (req.folding and self.persist_turn is not None):
            def answer() -> None:
                self._emit_final(req, reason, error, error_code, error_status)
            if not (persist and self.persist_turn(req, answer)):
                answer()

    def _keep(self, req: Req) -> bool:
        """The final state to the tree; hybrids: with the KV of its tokens, where they end on a page (else its
        rolling snapshot goes instead: ``RollingSnapshots.end``)."""
        tokens = req.tokens(req.in_state)
        if req.kv is None:
            return self.cache.keep(tokens, req.slot)
        return req.in_state % self.pages.page_size == 0 and self.cache.keep_kv(req.kv, tokens, req.slot)

    def refuse(self, req: Req, error: Exception) -> None:
        """A request that never ran: one output carrying the HTTP status and code of ``error``."""
        req.finish_reason = FinishReason.ABORT
        out = self._output(req, [], "", finish=FinishReason.ABORT, error=str(error))
        out.error_status, out.error_code = getattr(error, "status", None), getattr(error, "code", None)
        req.emit(out)

    def fail_running(self, message: str) -> None:
        for req in list(self.queues.running):
            self.finish(req, FinishReason.ABORT, error=message)

    @staticmethod
    def add_input_logprobs(plan: list, owner: list[int], result) -> None:
        """Append a step's prompt logprobs (``ModelRunner``'s ``input_logprobs``) to their requests."""
        chosen, top = result
        chosen = chosen.tolist()
        vals, ids = (top[0].tolist(), top[1].tolist()) if top is not None else (None, None)
        for e, i in enumerate(owner):
            req = plan[i][0]
            req.input_logprobs.append(chosen[e])
            k = req.top_logprobs_num
            req.input_top_logprobs.append(list(zip(ids[e][:k], vals[e][:k])) if k and ids is not None else [])

    # ---- increments ---------------------------------------------------------------------------------
    def _emit(self, req: Req, out: StepOutput) -> None:
        if req.logprob_start_len >= 0 and not req.input_sent:  # with the first output, once
            out.input_logprobs, out.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
            out.input_token_ids = req.prompt_ids[req.logprob_start_len:]
            req.input_sent = True
        req.emit(out)
        req.sent_tokens = len(req.output_ids)

    def _emit_final(self, req: Req, reason: FinishReason, error: str | None = None,
                    error_code: str | None = None, error_status: int | None = None) -> None:
        if req.timeline is not None:
            req.timeline.mark("finished")
        out = self._output(req, req.output_ids[req.sent_tokens:], req.detokenizer.release(final=True),
                           finish=reason, error=error)
        out.error_code = error_code or ("internal_error" if error else None)
        out.error_status = error_status
        out.session_persisted = req.persisted
        self._emit(req, out)

    @staticmethod
    def _output(req: Req, token_ids, text, finish=None, error=None) -> StepOutput:
        start = req.sent_tokens
        return StepOutput(
            rid=req.rid, token_ids=list(token_ids), text=text,
            logprobs=req.logprobs[start:] if req.return_logprob else None,
            top_logprobs=req.top_logprobs[start:] if req.return_logprob else None,
            prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens, finish_reason=finish, matched_stop=req.matched_stop, error=error)
