"""Conversation sessions: bookkeeping only (ids, histories, turn rules, timeouts).

Plain Python; the scheduler owns the slots this table names (docs/design.md §6).

* A **streaming** session keeps its live state slot between turns. A turn sends only its new tokens;
  the session supplies the history and the turn prefills only the new tokens on top of the slot.
  Append-only: ``replace``, ``drop_previous_output``, a non-zero ``offset``, a ``rid`` other than the
  last turn's, or a second request while one is in flight are refused and leave the session intact.
* A **non-streaming** session keeps the token history of every turn; a turn branches from an earlier
  one (``rid``, default the last; ``offset`` cuts that turn's tokens; ``drop_previous_output`` leaves
  its output out; ``replace`` forgets the parent's other branches) and reuses state through the
  radix cache.

Ownership (docs/server-interface.md, "Session ownership"): a session is opened with a secret (made by the
API layer, returned to the client) whose hash it keeps as its ``owner``; snapshot files and persisted
records carry that hash, so a session restored from them answers to the same secret, and a session id
reopened after a close has a new owner. A caller who presents a secret must present the right one, and
with ``require_secret`` every caller must. A session opened with an API key answers only to that key.
Quotas: ``max_per_client`` open sessions per caller (its API key, else its address).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
import uuid
from dataclasses import dataclass, field


MAX_TIMEOUT_S = 7 * 24 * 3600  # no --max-session-timeout above it: an idle session must be reaped some day


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    """Who asks for a session verb: ``key`` (an API key's fingerprint), ``address`` (the peer's), ``secret``
    (the session secret it presented), ``new_secret`` (the one a session it opens gets)."""

    key: str | None = None
    address: str | None = None
    secret: str | None = None
    new_secret: str | None = None

    @property
    def client(self) -> str | None:
        """Whom quotas count: the API key, else the address."""
        return f"key:{self.key}" if self.key else f"addr:{self.address}" if self.address else None


class SessionError(Exception):
    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Turn:
    rid: str
    parent: str | None
    input_len: int  # tokens of this turn's full prompt (history + new)
    tokens: list[int]  # prompt + output once finished
    children: list[str] = field(default_factory=list)


@dataclass
class Session:
    id: str
    streaming: bool
    timeout: float
    capacity: int | None
    last_active: float
    history: list[int] = field(default_factory=list)  # committed tokens of finished turns (streaming)
    slot: int | None = None  # live state after history[:in_state] (streaming, between turns)
    in_state: int = 0
    kv: object | None = None  # hybrids: the KV pages of history[:in_state] with the live state (cache.pages.KVHold)
    in_flight: str | None = None  # rid of the running turn
    closing: str | None = None  # close reason, deferred until the in-flight turn ends
    awaiting_fold: str | None = None  # rid of an answered turn whose last token is still being folded in
    turns: dict[str, Turn] = field(default_factory=dict)
    last_rid: str | None = None
    owner: str = ""  # secret_hash of the secret it was opened with ("": none, e.g. a file of an older version)
    key: str | None = None  # the API key (fingerprint) that opened it: no other key may use it
    client: str | None = None  # Caller.client of its opener (quotas)
    # --session-persist: what its record on storage names (the engine's, opaque here), and whether its live
    # state was read from storage and no turn has used it yet
    persisted: dict | None = None
    from_storage: bool = False


@dataclass(frozen=True)
class OpenParams:
    """A session opened by its first turn (``/open_session``'s fields)."""

    streaming: bool = False
    timeout: float | None = None
    capacity: int | None = None


@dataclass(frozen=True)
class TurnParams:
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False
    open: OpenParams | None = None  # open the session (this id) before the turn
    close: bool = False  # close the session once the turn ends
    caller: Caller = Caller()


class SessionTable:
    def __init__(self, max_sessions: int, default_timeout: float, max_timeout: float = 3600.0,
                 max_per_client: int | None = None, require_secret: bool = False):
        self.max_sessions = max_sessions
        self.default_timeout = default_timeout
        self.max_timeout = max_timeout
        self.max_per_client = max_per_client
        self.require_secret = require_secret
        self.sessions: dict[str, Session] = {}
        self.per_client: dict[str, int] = {}

    def open(self, session_id: str | None, streaming: bool, timeout: float | None, capacity: int | None,
             now: float | None = None, caller: Caller = Caller(), owner: str | None = None) -> Session:
        """A new session; its owner is ``owner`` (restored from a file or record) or the hash of the caller's
        ``new_secret``. Quotas count against ``caller``."""
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise SessionError(409, f"session {sid!r} already exists", "session_exists")
        if len(self.sessions) >= self.max_sessions:
            raise SessionError(429, f"too many open sessions ({self.max_sessions}); close one or retry later",
                               "too_many_sessions")
        client = caller.client
        if self.max_per_client is not None and client is not None \
                and self.per_client.get(client, 0) >= self.max_per_client:
            raise SessionError(429, f"this client has {self.max_per_client} open sessions, its quota "
                               "(--max-sessions-per-client); close one or retry later", "too_many_sessions")
        if timeout is not None and not (math.isfinite(timeout) and 0 < timeout <= self.max_timeout):
            raise SessionError(400, f"timeout must be in (0, {self.max_timeout:g}] seconds "
                               f"(--max-session-timeout), got {timeout}", "invalid_request")
        if owner is None:
            owner = secret_hash(caller.new_secret) if caller.new_secret else ""
        s = Session(sid, streaming, timeout or self.default_timeout, capacity,
                    time.monotonic() if now is None else now, owner=owner, key=caller.key, client=client)
        self.sessions[sid] = s
        if client is not None:
            self.per_client[client] = self.per_client.get(client, 0) + 1
        return s

    def check(self, s: Session, caller: Caller) -> Session:
        """``caller`` may use ``s``: the API key that opened it, and its secret when one is presented (always,
        with ``require_secret``). A refusal is 403 and changes nothing."""
        if s.key is not None and caller.key != s.key:
            raise SessionError(403, f"session {s.id!r} was opened with another API key", "session_forbidden")
        self.check_owner(s.owner, caller, f"session {s.id!r}")
        return s

    def check_owner(self, owner: str, caller: Caller, what: str) -> None:
        """The secret ``caller`` presents hashes to ``owner``; checked when it presents one, and always with
        ``require_secret`` (then something without an owner cannot be used at all). A turn that opened its
        session proves it by the new secret it gave it."""
        if caller.secret is None and not self.require_secret:
            return
        proof = caller.secret or caller.new_secret
        if not (proof and owner and hmac.compare_digest(secret_hash(proof), owner)):
            raise SessionError(403, f"{what} needs its session's secret: the x-session-secret header of the "
                               "response that opened the session, sent back as session_params.secret or the "
                               "x-session-secret header", "session_forbidden")

    def get(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None or s.closing:
            raise SessionError(404, f"session {sid!r} does not exist on this server or is closed (behind "
                               "sglang-router, send every turn of a session with the same x-smg-routing-key)",
                               "session_not_found")
        return s

    def remove(self, sid: str) -> Session:
        s = self.sessions.pop(sid)
        if s.client is not None:
            left = self.per_client[s.client] - 1
            if left:
                self.per_client[s.client] = left
            else:
                del self.per_client[s.client]
        return s

    def turn_prompt(self, s: Session, new_tokens: list[int], p: TurnParams) -> list[int]:
        """The full prompt of the next turn (history + new tokens); raises SessionError if not allowed."""
        self.check(s, p.caller)
        if not new_tokens:
            raise SessionError(400, "a session turn needs new input tokens", "invalid_request")
        if s.in_flight is not None:
            raise SessionError(409, f"session {s.id!r} has a turn in flight ({s.in_flight}); wait for it",
                               "session_busy")
        if s.streaming:
            if p.replace or p.drop_previous_output or p.offset not in (None, 0, -1):
                raise SessionError(400, "streaming sessions are append-only: replace, drop_previous_output and "
                                   "offset are not allowed", "session_append_only")
            if p.rid is not None and p.rid != s.last_rid:
                raise SessionError(400, f"streaming sessions are append-only: rid must be the last turn "
                                   f"({s.last_rid}), got {p.rid!r}", "session_append_only")
            prompt = s.history + new_tokens
        else:
            parent = p.rid if p.rid is not None else s.last_rid
            base: list[int] = []
            if parent is not None:
                if parent not in s.turns:
                    raise SessionError(404, f"session {s.id!r} has no turn {parent!r}", "turn_not_found")
                t = s.turns[parent]
                base = t.tokens[:t.input_len] if p.drop_previous_output else t.tokens
                if p.offset is not None and p.offset >= 0:
                    base = base[:p.offset]
            prompt = base + new_tokens
        if s.capacity and len(prompt) > s.capacity:
            raise SessionError(400, f"session {s.id!r} would hold {len(prompt)} tokens, over its capacity "
                               f"{s.capacity}", "session_full")
        return prompt

    def record_turn(self, s: Session, rid: str, p: TurnParams, prompt: list[int]) -> None:
        s.in_flight = rid
        if not s.streaming:
            parent = p.rid if p.rid is not None else s.last_rid
            if parent is not None and p.replace:
                for child in s.turns[parent].children:
                    self._forget(s, child)
                s.turns[parent].children = []
            s.turns[rid] = Turn(rid, parent, len(prompt), list(prompt))
            if parent is not None:
                s.turns[parent].children.append(rid)

    def _forget(self, s: Session, rid: str) -> None:
        t = s.turns.pop(rid, None)
        for child in t.children if t else []:
            self._forget(s, child)

    def end_turn(self, s: Session, rid: str, tokens: list[int], completed: bool, now: float | None = None) -> None:
        """A turn ended. Completed turns extend the history; an aborted one leaves the history as it was."""
        s.in_flight = None
        s.last_active = time.monotonic() if now is None else now
        if not completed:
            if not s.streaming:
                t = s.turns.get(rid)
                if t is not None:
                    t.tokens = t.tokens[:t.input_len]
            return
        if s.streaming:
            s.history = list(tokens)
        else:
            s.turns[rid].tokens = list(tokens)
        s.last_rid = rid

    def expired(self, now: float) -> list[Session]:
        return [s for s in self.sessions.values()
                if s.in_flight is None and not s.closing and now - s.last_active > s.timeout]

    @property
    def held_slots(self) -> list[int]:
        return [s.slot for s in self.sessions.values() if s.slot is not None]
