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
from mambaserve.server.cache.prefix_cache import PrefixCache
from mambaserve.server.cache.storage_backend import FileSystemBackend
from mambaserve.server.cache.storage_tier import StorageTier
from mambaserve.server.cache.storage_worker import Result, StorageWorker
from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.metrics import ServerMetrics
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.request import Req, RequestQueues
from mambaserve.server.sessions.manager import SessionManager
from mambaserve.server.sessions.snapshot import SnapshotError, check_session
from mambaserve.server.sessions.table import Caller, SessionError

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
    worker = StorageWorker(FileSystemBackend(cfg.storage_dir), compat, pool.conv, pool.ssm, post, page_size=page_size,
                           vocab=runner.model.dims.vocab_size)
    tier = StorageTier(worker, host, metrics, page_size=page_size, capacity=cfg.storage_size,
                       entry_bytes=runner.pool.bytes_per_slot, write_policy=cfg.cache_write_policy,
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
            req.prefetch = self.storage.prefetch(req.prompt_ids[:-1], have)
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
                req.prefetch = self.storage.prefetch(req.prompt_ids[:-1], have)
                if req.prefetch is None:
                    return
            self.wanting.popleft()

    def all_held(self) -> bool:
        """Every waiting request is held for its read (the prefetch policy): nothing to admit for now."""
        now = time.monotonic()
        return bool(self.queues.waiting) and all(r.prefetch is not None and r.prefetch.holds(now)
                                                 for r in self.queues.waiting)


class SessionPersistence:
    """``--session-persist``: each streaming turn's final state goes to the storage tier with a record of
    its session; a turn for a session id this server does not know looks the record up and recreates
    the session, whose state then comes back as an ordinary prefix hit from storage."""

    def __init__(self, storage: StorageTier, cache: PrefixCache, sessions: SessionManager, metrics: ServerMetrics,
                 compat: dict, vocab: int, context_length: int):
        self.storage, self.cache, self.sessions, self.metrics = storage, cache, sessions, metrics
        self.compat, self.vocab, self.context_length = compat, vocab, context_length

    def persist_turn(self, req: Req) -> None:
        """A streaming turn ended with its state covering the whole history: the state goes to storage
        (through the host tier), then the session's record naming it."""
        s = req.session
        tokens = req.prompt_ids + req.output_ids
        if not s.streaming or req.slot is None or req.in_state != len(tokens):
            return
        self.cache.write_to_storage(tokens, req.slot)
        record = {"id": s.id, "streaming": True, "timeout": s.timeout, "capacity": s.capacity, "history": tokens,
                  "compat": self.compat, "owner": s.owner, "key": s.key}
        self.storage.put_session(s.id, record, self.cache.pending,
                                 still_open=lambda: self.sessions.table.sessions.get(s.id) is s and not s.closing)

    def look_up(self, req: Req, then: Callable[[Req], None]) -> bool:
        """For a turn naming an unknown session: look its record up (on the I/O thread), recreate the session
        if there is one, then ``then(req)`` takes the turn again. False when it was looked up already."""
        if req.revived or req.session_id in self.sessions.table.sessions:
            return False
        req.revived = True

        def found(record: dict | None) -> None:
            self._revive(req, record)
            then(req)
        self.storage.get_session(req.session_id, found)
        return True

    def _revive(self, req: Req, record: dict | None) -> None:
        sid = req.session_id
        if record is None:
            return
        try:
            check_record(record, sid, self.compat, self.vocab, self.context_length)
        except SnapshotError as e:
            self.metrics.files_rejected.labels("record", e.reason).inc()
            log.warning("persisted session %s not restored (%s): %s", sid, e.reason, e)
            return
        if sid not in self.sessions.table.sessions:
            meta = {"id": sid, "streaming": True, "timeout": record["timeout"], "capacity": record["capacity"],
                    "in_state": 0, "owner": record.get("owner")}
            key = record.get("key") if isinstance(record.get("key"), str) else None
            try:  # its owner and API key come back with it; the turn that revived it is checked against them
                self.sessions.restore(meta, record["history"], sid, None, Caller(key=key), check=False)
                self.metrics.session_restores.inc()
                log.info("session %s continued from its persisted turn (%d tokens)", sid, len(record["history"]))
            except SessionError as e:
                log.warning("persisted session %s not restored: %s", sid, e)


def check_record(record: object, sid: str, compat: dict, vocab: int, context_length: int) -> None:
    """A session record as ``persist_turn`` writes it: this session's, this model's, a history of at least one
    turn that ``snapshot.check_session`` accepts (a damaged or foreign file is not trusted). Raises
    SnapshotError with the reason."""
    if not isinstance(record, dict) or record.get("id") != sid or record.get("streaming") is not True:
        raise SnapshotError(400, "not this streaming session's record", "snapshot_invalid", "fields")
    if record.get("compat") != compat:
        raise SnapshotError(409, "written by another model or configuration", "snapshot_incompatible", "incompatible")
    if record.get("history") == []:
        raise SnapshotError(400, "an empty history (a record is written after a turn)", "snapshot_invalid", "empty")
    check_session(record, record.get("history"), vocab, context_length)
