"""Sessions inside the scheduler thread: who holds which slot between turns, timeouts, export/import.

``SessionTable`` (sessions.py) decides what a turn may do; this module moves slots between a
session, its running turn, the radix cache and the free list, and reads/writes a session's state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from mambaserve.server.sessions import snapshot as session_snapshot
from mambaserve.server.engine.metrics import ServerMetrics
from mambaserve.server.cache.prefix_cache import DisabledCache
from mambaserve.server.engine.request import Req
from mambaserve.server.sessions.table import Session, SessionError, SessionTable, TurnParams
from mambaserve.server.engine.state_pool import MambaStatePool

log = logging.getLogger(__name__)


class SessionManager:
    def __init__(self, table: SessionTable, cache: DisabledCache, pool: MambaStatePool, metrics: ServerMetrics,
                 snapshot_dir: Path, compat: dict, apply_pending):
        self.table, self.cache, self.pool, self.metrics = table, cache, pool, metrics
        self.snapshot_dir = snapshot_dir
        self.compat = compat
        self._apply_pending = apply_pending  # runs the deferred state ops now (before reading state)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def open(self, session_id, streaming, timeout, capacity) -> str:
        return self.table.open(session_id, streaming, timeout, capacity).id

    def close(self, sid: str, reason: str = "client") -> None:
        s = self.table.get(sid)
        if s.in_flight is not None:
            s.closing = reason  # released when the in-flight turn ends
            return
        self._release(s, reason)

    def _release(self, s: Session, reason: str) -> None:
        if s.slot is not None:
            self.cache.free(s.slot)
            s.slot = None
        self.table.remove(s.id)
        self.metrics.sessions_closed.labels(reason).inc()

    def reap(self, now: float | None = None) -> None:
        for s in self.table.expired(time.monotonic() if now is None else now):
            log.info("session %s idle for more than %.0f s: closing", s.id, s.timeout)
            self._release(s, "timeout")

    # ---- turns --------------------------------------------------------------------------------------
    def begin_turn(self, req: Req, session_id: str, params: TurnParams, context_length: int) -> None:
        """Turn a request carrying only new tokens into the session's next turn (raises SessionError)."""
        s = self.table.get(session_id)
        prompt = self.table.turn_prompt(s, req.prompt_ids, params)
        if len(prompt) >= context_length:
            raise SessionError(400, f"session {session_id!r} history + this turn is {len(prompt)} tokens; the "
                               f"context length is {context_length}", "context_length_exceeded")
        if len(prompt) + req.params.max_new_tokens > context_length:
            req.params = dataclasses.replace(req.params, max_new_tokens=context_length - len(prompt))
        self.table.record_turn(s, req.rid, params, prompt)
        req.session = s
        req.prompt_ids = prompt

    def take_live_slot(self, req: Req) -> bool:
        """At admission: continue a streaming session's turn from its live slot (no copy, no re-prefill)."""
        s = req.session
        if s is None or not s.streaming or s.slot is None:
            return False
        req.slot, req.in_state = s.slot, s.in_state
        s.slot = None
        req.cached_tokens = req.in_state
        req.prefill_len = len(req.prompt_ids)  # nothing to donate: the last token runs in the prefill
        self.metrics.observe_lookup(len(req.prompt_ids), req.in_state, tier="session")
        return True

    def turn_answered(self, req: Req) -> None:
        """A streaming turn has its answer; its last token still runs once (the fold). The history is
        committed now so the client may send the next turn at once: it waits for the fold, not a 409."""
        s = req.session
        self.table.end_turn(s, req.rid, req.prompt_ids + req.output_ids, completed=True)
        s.awaiting_fold = req.rid

    def end_turn(self, req: Req, completed: bool) -> bool:
        """The turn ended; returns True if the session took the request's slot."""
        s = req.session
        tokens = req.prompt_ids + req.output_ids
        if s.awaiting_fold == req.rid:
            s.awaiting_fold = None  # history was committed when the answer went out
        else:
            self.table.end_turn(s, req.rid, tokens, completed)
        if self.table.sessions.get(s.id) is not s:
            return False  # closed meanwhile: the slot goes back to the cache
        took = False
        if s.streaming and completed and req.slot is not None and req.in_state == len(tokens):
            s.slot, s.in_state = req.slot, req.in_state
            took = True
        if s.closing:
            self._release(s, s.closing)
        return took

    # ---- export / import ----------------------------------------------------------------------------
    def _path(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise SessionError(400, f"invalid snapshot name {name!r} (a plain file name)", "invalid_request")
        return self.snapshot_dir / name

    def snapshot(self, sid: str, name: str | None) -> dict:
        s = self.table.get(sid)
        if s.in_flight is not None:
            raise SessionError(409, f"session {sid!r} has a turn in flight; snapshot it between turns", "session_busy")
        if s.awaiting_fold:
            raise SessionError(409, f"session {sid!r} is finishing its last turn", "session_folding")
        state = None
        if s.slot is not None:
            self._apply_pending()
            state = {"conv": self.pool.conv[:, s.slot].clone(), "ssm": self.pool.ssm[:, s.slot].clone()}
        tokens = s.history if s.streaming else (s.turns[s.last_rid].tokens if s.last_rid else [])
        path = self._path(name or f"{sid}.safetensors")
        meta = {"id": s.id, "streaming": s.streaming, "timeout": s.timeout, "capacity": s.capacity,
                "in_state": s.in_state if state is not None else 0}
        size = session_snapshot.write(path, self.compat, meta, tokens, state)
        return {"path": str(path), "name": path.name, "bytes": size, "tokens": len(tokens),
                "has_state": state is not None}

    def restore(self, name: str, session_id: str | None) -> dict:
        try:
            meta, tokens, state = session_snapshot.read(self._path(name), self.compat)
        except session_snapshot.SnapshotError as e:
            raise SessionError(e.status, str(e), e.code) from None
        slot = None
        if state is not None:
            if tuple(state["conv"].shape) != tuple(self.pool.conv[:, 0].shape) or \
                    tuple(state["ssm"].shape) != tuple(self.pool.ssm[:, 0].shape):
                raise SessionError(409, "snapshot state shapes do not match this model", "snapshot_incompatible")
            slot = self.cache.alloc()
            if slot is None:
                raise SessionError(503, "no free state slot to restore the session into; retry later",
                                   "no_capacity")
        try:
            s = self.table.open(session_id or meta["id"], meta["streaming"], meta["timeout"], meta["capacity"])
        except SessionError:
            if slot is not None:
                self.cache.free(slot)
            raise
        if s.streaming:
            s.history = list(tokens)
        elif tokens:
            from mambaserve.server.sessions.table import Turn

            s.turns["restored"] = Turn("restored", None, len(tokens), list(tokens))
            s.last_rid = "restored"
        if slot is not None:
            self._apply_pending()  # a stale deferred op must not land on the restored state
            self.pool.conv[:, slot] = state["conv"].to(self.pool.conv.device, self.pool.conv.dtype)
            self.pool.ssm[:, slot] = state["ssm"].to(self.pool.ssm.device, self.pool.ssm.dtype)
            s.slot, s.in_state = slot, meta["in_state"]
        self.metrics.session_restores.inc()
        return {"session_id": s.id, "tokens": len(tokens), "has_state": slot is not None}

    @property
    def held_slots(self) -> list[int]:
        return self.table.held_slots

