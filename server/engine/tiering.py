"""The scheduler's side of the storage tier: building it, reading prefixes on arrival, persisted sessions.

Runs on the scheduler thread; the storage tier itself (``cache.storage_tier``) decides what to move and
its I/O thread moves it. Nothing here runs without ``--storage-dir``.
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path
from typing import Callable

from mambaserve.server.cache.host_tier import HostTier
from mambaserve.server.cache.pages import KVHold
from mambaserve.server.cache.prefix_cache import PrefixCache
from mambaserve.server.cache.storage_backend import FileSystemBackend
from mambaserve.server.cache.storage_entry import same_compat
from mambaserve.server.cache.storage_tier import StorageTier
from mambaserve.server.cache.storage_worker import Result, SessionFile, StorageWorker
from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.metrics import ServerMetrics
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.request import Req, RequestQueues
from mambaserve.server.sessions.manager import SessionManager
from mambaserve.server.sessions.snapshot import SnapshotError, check_session
from mambaserve.server.sessions.table import Caller, SessionError, Turn

log = logging.getLogger(__name__)


def build_storage_tier(cfg: ServerConfig, runner: ModelRunner, host: HostTier, metrics: ServerMetrics,
                       compat: dict, post: Callable[[Result], None]) -> StorageTier:
    """The storage tier over ``--storage-dir`` (its first scan runs here, before serving); a directory that
    cannot be created starts it degraded. ``post`` hands the I/O thread's results to the scheduler."""
    try:
        Path(cfg.storage_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.error("storage tier: cannot create %s: %s", cfg.storage_dir, e.strerror)
    pool, page_size = runner.host_pool, host.tree.page_size
    kv = None
    if runner.kv_pool is not None:  # (hybrids) one token's K (or V): every attention layer's heads
        k = runner.kv_pool.k
        kv = ((k.shape[0], *k.shape[3:]), k.dtype)
    worker = StorageWorker(FileSystemBackend(cfg.storage_dir), compat, pool.conv, pool.ssm, post, page_size=page_size,
                           vocab=runner.model.dims.vocab_size, kv=kv, session_expiry_s=cfg.max_session_timeout)
    tier = StorageTier(worker, host, metrics, page_size=page_size, capacity=cfg.storage_size,
                       entry_bytes=runner.slot_bytes, write_policy=cfg.cache_write_policy,
                       kv_token_bytes=runner.kv_pool.bytes_per_page // page_size if runner.kv_pool else 0,
                       write_threshold=cfg.cache_write_threshold, prefetch_policy=cfg.cache_prefetch_policy,
                       prefetch_timeout=cfg.cache_prefetch_timeout)
    tier.fence = runner.fence
    log.info("storage cache tier: %s, %d entries (%.2f GiB) found, capacity %.2f GiB%s; write %s, prefetch %s",
             cfg.storage_dir, len(tier.entries), tier.used / 2**30, tier.capacity / 2**30,
             "" if cfg.storage_size else " (free space less a margin)", cfg.cache_write_policy,
             cfg.cache_prefetch_policy)
    return tier


class Prefetcher:
    """On a request's arrival, a prefix found on storage only (longer than the device and host tiers hold)
    is read into the host tier while the request waits; arrivals that found no host slot to read into
    retry, oldest first, as admitted requests free theirs (a burst larger than the host tier)."""

    def __init__(self, storage: StorageTier, cache: PrefixCache, queues: RequestQueues):
        self.storage, self.cache, self.queues = storage, cache, queues
        self.wanting: collections.deque[Req] = collections.deque()

    def on_arrival(self, req: Req) -> int:
        """Start ``req``'s read if storage has more; returns the tokens the tiers above hold (its estimate)."""
        where = self.cache.residency(req.prompt_ids[:-1])
        have = max(where["gpu"], where["host"])
        if where["storage"] > have:
            req.prefetch = self.storage.prefetch(req.prompt_ids[:-1], have, hold=req.revived)
            if req.prefetch is None:
                self.wanting.append(req)
        return have

    def retry(self) -> None:
        while self.wanting:
            req = self.wanting[0]
            if req.slot is not None or req.finished or req.rid not in self.queues.by_rid:
                self.wanting.popleft()  # admitted or gone meanwhile
                continue
            where = self.cache.residency(req.prompt_ids[:-1])
            have = max(where["gpu"], where["host"])
            if where["storage"] > have:
                req.prefetch = self.storage.prefetch(req.prompt_ids[:-1], have, hold=req.revived)
                if req.prefetch is None:
                    return
            self.wanting.popleft()

    def all_held(self) -> bool:
        """Every waiting request is held for its read (the prefetch policy): nothing to admit for now."""
        now = time.monotonic()
        return bool(self.queues.waiting) and all(r.prefetch is not None and r.prefetch.holds(now)
                                                 for r in self.queues.waiting)


class SessionPersistence:
    """``--session-persist``: every session turn that completes is written to the storage directory before it
    is answered, so a turn for a session id this server does not know (a restart, or another pod on the same
    volume) looks the session up and goes on from its last answered turn, its state loaded, not recomputed.

    * A streaming session: its live state (covering its whole history) copied out of its slot, written as the
      session's state file, then the record naming it (``session-records/``, by the hash of the id); hybrids:
      the KV of the tokens not persisted yet in a file of its own (a turn writes its new tokens' KV only). Revived
      straight into a slot (and KV pages): its next turn continues from that live state.
    * A non-streaming session: its turns (a tree) in the record, each with the length of its state in the
      storage tier's entries (written through the host tier as any snapshot); revived, a turn's prompt hits
      that entry as an ordinary prefix from storage.
    """

    def __init__(self, storage: StorageTier, cache: PrefixCache, sessions: SessionManager, metrics: ServerMetrics,
                 compat: dict, vocab: int, context_length: int, runner: ModelRunner):
        self.storage, self.cache, self.sessions, self.metrics = storage, cache, sessions, metrics
        self.compat, self.vocab, self.context_length = compat, vocab, context_length
        self.runner = runner
        self.pages = cache.pages  # hybrid models: KV pages persisted and restored with the state

    # ---- writing ------------------------------------------------------------------------------------
    def persist_turn(self, req: Req, then: Callable[[], None]) -> bool:
        """``req``'s completed turn to storage (its slot and KV already handed to the session, or the cache);
        ``then()`` runs once it is on disk (or its write failed). False when nothing is written (no call).
        ``req.persisted`` says which (its answer tells the client: ``x-session-persisted``)."""
        s = req.session
        if self.sessions.table.sessions.get(s.id) is not s:
            return False

        def done(ok: bool) -> None:
            req.persisted = ok
            if not ok:  # full, read-only or gone: the session goes on, this turn unpersisted
                self.metrics.session_turns_not_persisted.inc()
            then()
        if not self.storage.writable:
            done(False)
            return True
        if s.streaming:
            return self._persist_streaming(s, done)
        return self._persist_turns(s, req.rid, done)

    def _record(self, s) -> dict:
        return {"id": s.id, "streaming": s.streaming, "timeout": s.timeout, "capacity": s.capacity,
                "compat": self.compat, "owner": s.owner, "key": s.key}

    def _persist_streaming(self, s, then: Callable[[bool], None]) -> bool:
        """The live state if the session holds one covering its history (else the record names the state it
        named before: a restore prefills the rest), with the KV of the tokens since the last persisted turn."""
        done = s.persisted or {"state": 0, "kv": []}
        n, chunks, files, event = done["state"], done["kv"], [], None
        if s.slot is not None and s.in_state == len(s.history) > done["state"]:
            n = s.in_state
            kv = None
            if self.pages is not None:
                a = chunks[-1][1] if chunks else 0
                chunks = chunks + [[a, n]]
                kv = (self.cache.block_table(s.kv), a, n)
            state, event = self.runner.copy_out(s.slot, kv)
            files.append(SessionFile(f"{n}.state", s.history[:n], [state["conv"], state["ssm"]]))
            if kv is not None:
                files.append(SessionFile(f"{kv[1]}-{n}.kv", s.history[:n], [state["k"], state["v"]], kv_from=kv[1]))
        record = {**self._record(s), "history": s.history, "state": n, "kv": chunks}
        obsolete = [f"{done['state']}.state"] if done["state"] and done["state"] != n else []
        covers = len(s.history)

        def written(ok: bool) -> None:
            if ok:
                s.persisted = {"state": n, "kv": chunks, "covers": covers}
            then(ok)
        self.storage.put_session(s.id, record, files, obsolete, event, written)
        return True

    def _persist_turns(self, s, rid: str, then: Callable[[bool], None]) -> bool:
        """The record of every turn, with the state of this one: the deepest snapshot the tree holds on its tokens
        (kept there by its end), written to storage unless it is there already; the record goes after it."""
        states = dict((s.persisted or {}).get("turns", {}))
        turn = s.turns.get(rid)
        if turn is not None and self.cache.enabled:
            m = self.cache.tree.match_prefix(turn.tokens)
            key = turn.tokens[:m.length]
            if m.length and (self.storage.has(key) or tuple(key) in self.storage.writing
                             or self.cache.write_to_storage(key, m.node.slot)):
                states[rid] = m.length
        covers = s.last_rid
        record = {**self._record(s), "last_rid": s.last_rid,
                  "turns": [{"rid": t.rid, "parent": t.parent, "input_len": t.input_len, "tokens": t.tokens,
                             "state": states.get(t.rid, 0)} for t in s.turns.values()]}

        def written(ok: bool) -> None:
            if ok:
                s.persisted = {"turns": states, "covers": covers}
            then(ok)
        # (queued after the state's write, which waits for its offload: both are issued with the next step)
        self.cache.pending.on_done.append(
            lambda event: self.storage.put_session(s.id, record, [], [], None, written))
        return True

    def persist_open(self, then: Callable[[int, list[str]], None]) -> None:
        """Drain: every open session whose record on storage is behind it (``persisted["covers"]``: a write that
        failed, a session restored from a snapshot file and not used since) written now; ``then(written, ids not
        on storage)`` once all have landed. A session without a turn yet has nothing to persist (listed)."""
        behind, empty, failed = [], [], []
        for s in self.sessions.table.sessions.values():
            covers = len(s.history) if s.streaming else s.last_rid
            if not covers:
                empty.append(s.id)
            elif s.closing is None and (s.persisted or {}).get("covers") != covers:
                behind.append(s)
        left = len(behind)

        def one(sid: str, ok: bool) -> None:
            nonlocal left
            left -= 1
            if not ok:
                failed.append(sid)
            if not left:
                then(len(behind) - len(failed), empty + failed)
        if not behind:
            then(0, empty)
        for s in behind:  # (storage read-only or off: each put_session says so at once)
            if s.streaming:
                self._persist_streaming(s, lambda ok, sid=s.id: one(sid, ok))
            else:
                self._persist_turns(s, s.last_rid, lambda ok, sid=s.id: one(sid, ok))

    # ---- reading ------------------------------------------------------------------------------------
    def look_up(self, req: Req, then: Callable[[Req], None]) -> bool:
        """For a turn naming an unknown session: look its record up (on the I/O thread), recreate the session
        if there is one, then ``then(req)`` takes the turn again. False when it was looked up already."""
        if req.revived or req.session_id in self.sessions.table.sessions:
            return False
        req.revived = True
        started = time.monotonic()

        def found(record: dict | None, state: dict | None, why: str) -> None:
            self._revive(req, record, state, why, started)
            then(req)
        self.storage.get_session(req.session_id, found)
        return True

    def _revive(self, req: Req, record: dict | None, state: dict | None, why: str, started: float) -> None:
        sid = req.session_id
        if record is None:
            return
        try:
            check_record(record, sid, self.compat, self.vocab, self.context_length)
        except SnapshotError as e:
            self.metrics.files_rejected.labels("record", e.reason).inc()
            self.metrics.session_restores.labels("rejected").inc()
            log.warning("persisted session %s not restored (%s): %s", sid, e.reason, e)
            return
        if sid in self.sessions.table.sessions:
            return
        meta = {"id": sid, "streaming": record["streaming"], "timeout": record["timeout"],
                "capacity": record["capacity"], "in_state": 0, "owner": record.get("owner")}
        key = record.get("key") if isinstance(record.get("key"), str) else None
        live = self._load_state(record, state) if record["streaming"] else None
        turns = None if record["streaming"] else {
            t["rid"]: Turn(t["rid"], t["parent"], t["input_len"], list(t["tokens"])) for t in record["turns"]}
        try:  # its owner and API key come back with it; the turn that revived it is checked against them
            s = self.sessions.restore({**meta, "in_state": live[1] if live else 0}, record.get("history") or [], sid,
                                      live[0] if live else None, Caller(key=key), check=False, turns=turns,
                                      last_rid=record.get("last_rid"))
        except SessionError as e:
            if live is not None:
                self._free(live)
            log.warning("persisted session %s not restored: %s", sid, e)
            return
        if record["streaming"]:
            s.kv = live[2] if live else None
            s.from_storage = live is not None
            s.persisted = {"state": record["state"] if live else 0, "kv": record["kv"] if live else [],
                           "covers": len(s.history)}
            loaded = live is not None
        else:
            s.persisted = {"turns": {t["rid"]: t["state"] for t in record["turns"] if t["state"]},
                           "covers": record["last_rid"]}
            loaded = any(t["state"] for t in record["turns"])
        self.metrics.session_restores.labels("loaded" if loaded else "recomputed").inc()
        self.metrics.session_restore_seconds.observe(time.monotonic() - started)
        log.info("session %s continued from its persisted turn (%d tokens%s)", sid,
                 len(record.get("history") or (record["turns"][-1]["tokens"] if record["turns"] else [])),
                 ", its state loaded" if loaded else (f"; its state not loaded: {why}" if why else ", recomputed"))

    def _load_state(self, record: dict, state: dict | None):
        """A streaming session's state read back (``state``) into a slot (and KV pages): (slot, tokens, KV hold),
        or None (its history is recomputed) without one to be had."""
        n = record["state"]
        if state is None or not n:
            return None
        slot = self.cache.alloc()
        if slot is None and self.sessions.spill_idle():
            slot = self.cache.alloc()
        if slot is None:
            log.warning("persisted session %s: no state slot to load its state into: its history is recomputed",
                        record["id"])
            return None
        hold = None
        if self.pages is not None:
            hold = KVHold()
            while not self.cache.extend_kv(hold, n):
                if not self.sessions.spill_idle():
                    self._free((slot, n, hold))
                    log.warning("persisted session %s: no KV pages for its %d tokens: its history is recomputed",
                                record["id"], n)
                    return None
        self.runner.apply_state_ops(self.cache.take_pending())  # (what was recorded before runs first)
        self.runner.load_in(slot, state, self.cache.block_table(hold) if hold is not None else None)
        return slot, n, hold

    def _free(self, live) -> None:
        slot, _, hold = live
        self.cache.free(slot)
        self.cache.release_kv(hold)


def check_record(record: object, sid: str, compat: dict, vocab: int, context_length: int) -> None:
    """A session record as ``SessionPersistence`` writes it: this session's, this model's, a streaming session's
    history of at least one turn (its state within it) or a non-streaming session's tree of turns, each
    accepted by ``snapshot.check_session`` (a damaged or foreign file is not trusted). Raises SnapshotError with
    the reason."""
    def invalid(what: str, reason: str = "fields"):
        raise SnapshotError(400, what, "snapshot_invalid", reason)

    if not isinstance(record, dict) or record.get("id") != sid or not isinstance(record.get("streaming"), bool):
        invalid("not this session's record")
    if not same_compat(record.get("compat"), compat):
        raise SnapshotError(409, "written by another model or configuration", "snapshot_incompatible", "incompatible")
    if record["streaming"]:
        history = record.get("history")
        if history == []:
            invalid("an empty history (a record is written after a turn)", "empty")
        check_session(record, history, vocab, context_length)
        n, chunks = record.setdefault("state", 0), record.setdefault("kv", [])
        if type(n) is not int or not 0 <= n <= len(history) or not isinstance(chunks, list):
            invalid(f"its state covers {n!r} tokens of a history of {len(history)}")
        return
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns:
        invalid("no turns (a record is written after a turn)", "empty")
    seen: set = set()
    for t in turns:
        if not isinstance(t, dict) or not isinstance(t.get("rid"), str) or t["rid"] in seen \
                or (t.get("parent") is not None and t.get("parent") not in seen):
            invalid("a turn without an id of its own or whose parent is not an earlier turn")
        check_session(record, t.get("tokens"), vocab, context_length)
        if type(t.get("input_len")) is not int or not 0 < t["input_len"] <= len(t["tokens"]) \
                or type(t.get("state")) is not int or not 0 <= t["state"] <= len(t["tokens"]):
            invalid(f"turn {t['rid']!r}: its prompt or state is not within its {len(t['tokens'])} tokens")
        seen.add(t["rid"])
    if record.get("last_rid") not in seen:
        invalid("its last turn is not one of its turns")
