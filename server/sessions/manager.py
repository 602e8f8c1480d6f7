"""Sessions inside the scheduler thread: which slot a session holds between turns, turns, timeouts.

``SessionTable`` (table.py) decides what a turn may do; this module moves slots between a session and
its running turn and releases them on close. Plain values in and out: the scheduler owns the
requests, the cache frees slots (``free_slot``), the model runner reads and writes state.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from mambaserve.server.sessions.table import Caller, Session, SessionError, SessionTable, Turn, TurnParams

log = logging.getLogger(__name__)


class SessionManager:
    """``max_held_slots`` bounds the slots idle streaming sessions hold between turns: past it, the least
    recently active one gives its live state up (``give_up(tokens, slot, kv)``: the cache keeps it as an
    ordinary snapshot, or frees it) and its next turn starts from the cache. So sessions can never hold
    the slots that waiting requests need, whatever their number. Hybrid models: a live state comes with
    the KV pages of its tokens (``kv``, opaque here), held and given up with it; ``free_slot(slot, kv)``
    releases both when a session closes."""

    def __init__(self, table: SessionTable, max_held_slots: int, free_slot: Callable[[int, object], None],
                 give_up: Callable[[list[int], int, object], None],
                 on_close: Callable[[str], None] = lambda reason: None,
                 on_release: Callable[[str], None] = lambda sid: None):
        self.table = table
        self._on_release = on_release  # called with the session id once it is gone (its persisted record too)
        self.max_held_slots = max_held_slots
        self._free_slot = free_slot
        self._give_up = give_up
        self._on_close = on_close  # called with the close reason (metrics)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def open(self, session_id: str | None, streaming: bool, timeout: float | None, capacity: int | None,
             caller: Caller = Caller()) -> str:
        return self.table.open(session_id, streaming, timeout, capacity, caller=caller).id

    def close(self, sid: str, reason: str = "client", caller: Caller | None = None) -> None:
        """Close ``sid`` (a client's close names itself as ``caller``, checked like a turn)."""
        s = self.table.get(sid)
        if caller is not None:
            self.table.check(s, caller)
        if s.in_flight is not None:
            s.closing = reason  # released when the in-flight turn ends
            return
        self._release(s, reason)

    def _release(self, s: Session, reason: str) -> None:
        if s.slot is not None:
            self._free_slot(s.slot, s.kv)
            s.slot = s.kv = None
        self.table.remove(s.id)
        self._on_close(reason)
        self._on_release(s.id)

    def reap(self, now: float | None = None) -> None:
        for s in self.table.expired(time.monotonic() if now is None else now):
            log.info("session %s idle for more than %.0f s: closing", s.id, s.timeout)
            self._release(s, "timeout")

    # ---- turns --------------------------------------------------------------------------------------
    def turn_prompt(self, session_id: str, new_tokens: list[int], params: TurnParams) -> list[int]:
        """The next turn's full prompt (history + new tokens); raises SessionError if the turn is not allowed."""
        return self.table.turn_prompt(self.table.get(session_id), new_tokens, params)

    def room(self, session_id: str, prompt_len: int) -> int | None:
        """Tokens a turn of ``prompt_len`` (history included) may still answer under the session's capacity
        (None: no capacity)."""
        cap = self.table.get(session_id).capacity
        return max(0, cap - prompt_len) if cap else None

    def begin_turn(self, session_id: str, rid: str, params: TurnParams, prompt: list[int]) -> Session:
        s = self.table.get(session_id)
        self.table.record_turn(s, rid, params, prompt)
        return s

    @staticmethod
    def take_live_slot(s: Session) -> tuple[int, int, object] | None:
        """At admission: a streaming session's live ``(slot, in_state, kv)``, handed to its turn (no copy, no
        re-prefill), or None when the turn must start from the cache."""
        if not s.streaming or s.slot is None:
            return None
        live, s.slot, s.kv = (s.slot, s.in_state, s.kv), None, None
        return live

    def turn_answered(self, s: Session, rid: str, tokens: list[int]) -> None:
        """A streaming turn has its answer; its last token still runs once (the fold). The history is
        committed now so the client may send the next turn at once: it waits for the fold, not a 409."""
        self.table.end_turn(s, rid, tokens, completed=True)
        s.awaiting_fold = rid

    def end_turn(self, s: Session, rid: str, tokens: list[int], completed: bool, slot: int | None,
                 in_state: int, kv: object | None = None) -> bool:
        """The turn ended with its state in ``slot`` covering ``in_state`` tokens (hybrids: their KV pages in
        ``kv``); returns True if the session took the slot and ``kv`` (else the caller still owns them)."""
        if s.awaiting_fold == rid:
            s.awaiting_fold = None  # history was committed when the answer went out
        else:
            self.table.end_turn(s, rid, tokens, completed)
        if self.table.sessions.get(s.id) is not s:
            return False  # closed meanwhile: the slot goes back to the cache
        took = s.streaming and completed and slot is not None and in_state == len(tokens) and self._make_room()
        if took:
            s.slot, s.in_state, s.kv = slot, in_state, kv
        if s.closing:
            self._release(s, s.closing)
        return took

    def _make_room(self) -> bool:
        """Room for one more held slot under the bound, after the least recently active idle session
        gave its state up if needed. (A session holds a slot only between turns.)"""
        holders = [x for x in self.table.sessions.values() if x.slot is not None]
        if len(holders) < self.max_held_slots:
            return True
        if not holders:
            return False  # the bound is 0: sessions hold nothing between turns
        oldest = min(holders, key=lambda x: x.last_active)
        log.info("session %s gives up its live state: sessions hold %d of at most %d slots", oldest.id,
                 len(holders), self.max_held_slots)
        self._spill(oldest)
        return len(holders) - 1 < self.max_held_slots

    def _spill(self, s: Session) -> None:
        self._give_up(s.history[:s.in_state], s.slot, s.kv)
        s.slot, s.in_state, s.kv = None, 0, None

    def give_up_live(self, s: Session) -> None:
        """``s``'s live state (if it holds one) to the cache: its turn starts from there (it needs positions
        the live state is past, e.g. for prompt logprobs)."""
        if s.slot is not None:
            self._spill(s)

    def spill_idle(self, exclude: Session | None = None) -> bool:
        """Under memory pressure (a request finds no slot, or no KV pages): the least recently active idle
        session but ``exclude`` gives its live state to the cache, from where eviction moves it down to
        the host (and storage) tier or frees it; its next turn finds it there by prefix. False when no
        such session holds a slot."""
        holders = [x for x in self.table.sessions.values() if x.slot is not None and x is not exclude]
        if not holders:
            return False
        self._spill(min(holders, key=lambda x: x.last_active))
        return True

    # ---- export / import ----------------------------------------------------------------------------
    def export(self, sid: str, caller: Caller = Caller()) -> tuple[Session, list[int], dict]:
        """A session between turns: (session, its tokens, the fields a snapshot file keeps)."""
        s = self.table.check(self.table.get(sid), caller)
        if s.in_flight is not None:
            raise SessionError(409, f"session {sid!r} has a turn in flight; snapshot it between turns", "session_busy")
        if s.awaiting_fold:
            raise SessionError(409, f"session {sid!r} is finishing its last turn", "session_folding")
        tokens = s.history if s.streaming else (s.turns[s.last_rid].tokens if s.last_rid else [])
        meta = {"id": s.id, "streaming": s.streaming, "timeout": s.timeout, "capacity": s.capacity,
                "in_state": s.in_state if s.slot is not None else 0, "owner": s.owner}
        return s, tokens, meta

    def restore(self, meta: dict, tokens: list[int], session_id: str | None, slot: int | None,
                caller: Caller = Caller(), check: bool = True, turns: dict[str, Turn] | None = None,
                last_rid: str | None = None) -> Session:
        """Recreate a session from a snapshot's fields; ``slot`` (already written) holds its live state. It
        keeps the file's owner (the same secret works; with ``check`` the caller must prove it, else its
        turns will), or gets the caller's new secret if the file has none. A timeout over this server's
        longest is cut to it. ``turns`` (a non-streaming session's, persisted): its turns as they were."""
        owner = meta.get("owner") if isinstance(meta.get("owner"), str) and meta.get("owner") else None
        if owner is not None and check:
            self.table.check_owner(owner, caller, "this snapshot")
        timeout = meta["timeout"] if meta["timeout"] is None else min(meta["timeout"], self.table.max_timeout)
        s = self.table.open(session_id or meta["id"], meta["streaming"], timeout, meta["capacity"],
                            caller=caller, owner=owner)
        if s.streaming:
            s.history = list(tokens)
        elif turns:
            s.turns, s.last_rid = turns, last_rid
            for t in turns.values():
                if t.parent is not None:
                    turns[t.parent].children.append(t.rid)
        elif tokens:
            s.turns["restored"] = Turn("restored", None, len(tokens), list(tokens))
            s.last_rid = "restored"
        if slot is not None:
            s.slot, s.in_state = slot, meta["in_state"]
        return s

    @property
    def held_slots(self) -> list[int]:
        return self.table.held_slots
