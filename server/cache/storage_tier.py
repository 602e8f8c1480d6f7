"""The storage tier (L3): snapshots on a local disk or a volume shared by pods, found again by prefix.

This half runs on the scheduler thread and only decides: an index of the entries (a radix tree of
its own, entry ids for slots, LRU by use), the bytes they take against the capacity, what to write
and when (the write policy), what to read on a request's arrival (the prefetch policy), and whether
the tier works at all (``degraded``). Every byte moves on the ``storage_worker`` thread; its results
come back through the scheduler's inbox (``apply``).

The data path always goes through the host tier (``host_tier``), whose pinned slots are the staging
area: device -> host is an ``offload`` state op, host -> disk a write job reading the locked host
entry once that op has run (``StateOps.on_done``); disk -> host a read job into a reserved host slot,
host -> device the ordinary host hit (a ``load`` op). So a loaded entry is always read by the forward
through the same ordered op list as any other.

Write policies (``--cache-write-policy``):
  * ``write_through``: a request's final snapshot (and a session's turn) goes to storage as soon as
    the device tree takes it, so a restart or another pod finds it at once;
  * ``write_through_selective``: a snapshot goes once it has been matched ``--cache-write-threshold``
    times (hot prefixes only: less disk traffic);
  * ``write_back``: a host entry goes to storage when the host tier fills (above 3/4 of its slots, least
    recently used first), so it is on disk before the host tier drops it; nothing is written while
    the host tier has room.
Prefetch policies (``--cache-prefetch-policy``): on arrival a request whose longest prefix is in
storage and nowhere higher starts a read; ``best_effort`` admits it whenever admission gets to it
(using what has landed by then), ``wait_complete`` holds its admission until the read has landed or
failed, ``timeout`` holds it at most ``--cache-prefetch-timeout`` seconds.

A directory that refuses writes (full, over a quota, a read-only filesystem) makes the tier *read-only*:
one log line, the degraded and read-only gauges at 1, no more writes (session turns go unpersisted,
counted), but entries and persisted sessions are still read, also at a start on a full volume. One that
is gone or unreadable *degrades* it: no reads either, requests served from the tiers above. A later
scan that finds the directory writable (and not nearly full) again ends either.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from mambaserve.server.cache.host_tier import HostLock, HostTier
from mambaserve.server.cache.radix_tree import MambaRadixCache
from mambaserve.server.cache.storage_worker import Job, Result, SessionFile, StorageWorker

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
MAX_INFLIGHT_WRITES = 4  # write-back keeps at most this many writes queued: the host tier stays evictable
WRITE_BACK_WATERMARK = 0.75
MARGIN_FRACTION, MARGIN_FLOOR = 0.05, 2**30  # default capacity: free disk minus max(5 %, 1 GiB)


def default_capacity(used: int, free: int, total: int) -> int:
    """Without ``--storage-size``: what the entries hold now plus the free space, less a margin of 5 % of
    the filesystem (at least 1 GiB) that the tier never fills (other files, other pods' writes racing)."""
    return max(0, used + free - max(MARGIN_FLOOR, int(MARGIN_FRACTION * total)))


@dataclass
class Prefetch:
    """A read from storage started for a waiting request."""

    key: tuple[int, ...]
    deadline: float  # time.monotonic(): admission holds the request until it is done or this passes
    done: bool = False
    # the landed entry stays locked in the host tier until its request is admitted (``release``): with
    # more waiting requests than host slots, later reads must not evict what earlier ones brought in
    lock: HostLock | None = None
    released: bool = False

    def holds(self, now: float) -> bool:
        return not self.done and now < self.deadline


@dataclass
class _Entry:
    name: str
    size: int


class StorageTier:
    def __init__(self, worker: StorageWorker, host: HostTier, metrics, *, page_size: int, capacity: int | None,
                 entry_bytes: int, write_policy: str = "write_through", write_threshold: int = 2,
                 prefetch_policy: str = "timeout", prefetch_timeout: float = 0.5, kv_token_bytes: int = 0):
        self.worker, self.host, self.metrics = worker, host, metrics
        self.page_size, self.entry_bytes = page_size, entry_bytes
        self.kv_token_bytes = kv_token_bytes  # hybrids: an entry holds its tokens' KV (K and V, every layer)
        # hybrids (PrefixCache.attach): an entry read lands its KV in the device tree, whose node at its key
        # comes back with its pages pinned (None: no pages for it); a host entry being written or waited for
        # pins them too (``HostLock.kv``), unpinned with it: KV eviction never takes a locked host entry's KV
        self.land_kv: Callable | None = None
        self.unpin_kv: Callable = lambda node: None
        self.sync_host: Callable[[], None] = lambda: None  # the host tier made room: the cache takes note
        self.deleted: list[tuple[int, ...]] = []  # keys of entries deleted for room (the cache's capacity misses)
        self.configured_capacity = capacity
        self.capacity = capacity or 0
        self.write_policy, self.write_threshold = write_policy, write_threshold
        self.prefetch_policy, self.prefetch_timeout = prefetch_policy, prefetch_timeout
        self.index = MambaRadixCache(page_size)
        self.entries: dict[int, _Entry] = {}
        self.by_name: dict[str, int] = {}
        # One int object per token id for the index's keys: an entry's key then costs 8 bytes a token (a
        # pointer) instead of 36 (an int object of its own for each id past 256): the index is the tier's
        # memory, an entry per stored snapshot. Bounded by the vocabulary.
        self._token_ids: dict[int, int] = {}
        self.used = 0
        self.pending_bytes = 0  # room taken by writes in flight (their entries are not in ``used`` yet)
        self.session_bytes = 0  # persisted sessions' records and files (not evicted: deleted with their sessions)
        self.writing: set[tuple[int, ...]] = set()  # keys being written (names are the worker's to hash)
        self.reads: dict[str, Prefetch] = {}
        self.jobs: dict[int, tuple] = {}  # job id -> what its result completes
        self.degraded = False  # nothing is read or written
        self.read_only = ""  # why writes are refused ("": they are not); reads go on
        self.evictions = 0
        self.fence: Callable[[], object] = lambda: None  # ModelRunner.fence: a CUDA event after launched work
        self._ids = itertools.count(1)
        self._maintained_at = -1
        self.apply(worker.run_now(Job("scan")))  # entries of earlier runs and other pods, before serving
        worker.start()

    # ---- lookups --------------------------------------------------------------------------------------
    @property
    def readable(self) -> bool:
        return not self.degraded

    @property
    def writable(self) -> bool:
        return not self.degraded and not self.read_only

    def match_length(self, tokens: Sequence[int]) -> int:
        return self.index.match_prefix(tokens).length if self.entries else 0

    def has(self, key: Sequence[int]) -> bool:
        return self.match_length(key) == len(key) > 0

    def wants(self, key: Sequence[int]) -> bool:
        """Whether a snapshot at ``key`` should be written now (not in storage, not being written, and the
        disk not behind: a queued write pins its host entry, and a host tier pinned whole by a slow disk
        would drop every snapshot the device evicts, so a write that would pin more than half is skipped)."""
        return (self.writable and len(key) > 0 and len(key) % self.page_size == 0 and not self.has(key)
                and tuple(key) not in self.writing and len(self.writing) < self.max_writing
                and self.entry_bytes <= self.capacity)

    @property
    def max_writing(self) -> int:
        return max(1, self.host.allocator.capacity // 2)

    # ---- writes ---------------------------------------------------------------------------------------
    def write_from_host(self, lock: HostLock, key: Sequence[int], ops, kv=None) -> None:
        """Write the locked host entry ``lock`` (at ``key``) once ``ops`` have run (its offload among them;
        hybrids: ``kv``, the ``KVCopy`` of its tokens' KV, filled by one of them); the lock is released when
        the write is done."""
        key = tuple(key)
        self.writing.add(key)
        ops.on_done.append(lambda event: self._submit_write(lock, key, event, kv))

    def _submit_write(self, lock: HostLock, key: tuple[int, ...], event, kv) -> None:
        size = self._estimate(key)
        if not self.writable or not self._make_room(size):
            self.writing.discard(key)
            self.host.unlock(lock)
            self.unpin_kv(lock.kv)
            return
        jid = next(self._ids)
        self.jobs[jid] = ("write", lock, key)
        self.pending_bytes += size
        # the name (a hash per page: milliseconds for a long prompt) is computed on the storage thread
        self.worker.submit(Job("write", jid, "", key, lock.slot, event, kv=kv))

    def _estimate(self, key: Sequence[int]) -> int:
        """An entry's size: the state (hybrids: and its tokens' KV), the JSON header (tokens as text, up to 8 bytes
        each) and the trailer."""
        return self.entry_bytes + (self.kv_token_bytes + 8) * len(key) + 1024

    def _make_room(self, size: int) -> bool:
        while self.used + self.session_bytes + self.pending_bytes + size > self.capacity:
            ids = self.index.evict(1, keys=self.deleted)
            if not ids:
                return False
            self.evictions += 1
            self._forget(ids[0], delete=True)
        return True

    def maintain(self) -> None:
        """``write_back``: queue writes of the least recently used host entries not in storage while the
        host tier is above its watermark, so that what it drops next has a copy on disk."""
        host = self.host
        if (self.write_policy != "write_back" or not self.writable or len(self.writing) >= MAX_INFLIGHT_WRITES
                or host.allocator.num_used < WRITE_BACK_WATERMARK * host.allocator.capacity
                or host.tree.clock == self._maintained_at):
            return
        self._maintained_at = host.tree.clock
        dirty = sorted((n for n in host.tree._owner.values() if not n.stored and not n.lock_ref),
                       key=lambda n: (n.last_access, n.depth))
        return dirty  # the caller records them on its op list (``PrefixCache.write_back``)

    # ---- reads ----------------------------------------------------------------------------------------
    def prefetch(self, tokens: Sequence[int], have: int, now: float | None = None, hold: bool = False
                 ) -> Prefetch | None:
        """Start reading the longest stored prefix of ``tokens`` into the host tier if it is longer than
        ``have`` (what the tiers above hold); None when there is nothing to read or no room. ``hold``: the
        request waits until the read has landed or failed, whatever the policy (a revived session's turn)."""
        if not self.readable or not self.entries:
            return None
        m = self.index.match_prefix(tokens)
        if m.length <= have:
            return None
        entry = self.entries[m.node.slot]
        if entry.name in self.reads:  # another request's read brings it: the first one admitted uses it
            return None
        slot = self.host.reserve()
        self.sync_host()
        if slot is None:
            return None
        now = time.monotonic() if now is None else now
        wait = {"best_effort": 0.0, "wait_complete": float("inf"), "timeout": self.prefetch_timeout}
        key = tuple(tokens[:m.length])
        ticket = Prefetch(key, now + (float("inf") if hold else wait[self.prefetch_policy]))
        jid = next(self._ids)
        self.jobs[jid] = ("read", slot, ticket)
        self.reads[entry.name] = ticket
        # the slot may have held an entry whose load to the device is launched but not run yet
        self.worker.submit(Job("read", jid, entry.name, key, slot, self.fence()))
        return ticket

    def release(self, ticket: Prefetch) -> None:
        """The request that started ``ticket`` was admitted or ended: the entry it read is an ordinary
        host entry from now on (a read still running is not locked when it lands)."""
        ticket.released = True
        if ticket.lock is not None:
            self.host.unlock(ticket.lock)
            self.unpin_kv(ticket.lock.kv)
            ticket.lock = None

    # ---- sessions -------------------------------------------------------------------------------------
    def put_session(self, sid: str, record: dict, files: list[SessionFile], obsolete: list[str], event,
                    done: Callable[[bool], None]) -> None:
        """Write a persisted session's ``files`` (host tensors, complete once ``event`` has passed), then its
        ``record`` naming them, then delete its ``obsolete`` files; ``done(ok)`` runs on the scheduler thread
        once that is on disk (or failed, or was skipped: the tier is read-only or off)."""
        if not self.writable:
            done(False)
            return
        jid = next(self._ids)
        self.jobs[jid] = ("put_session", done)
        self.worker.submit(Job("put_session", jid, sid, data=json.dumps(record).encode(), event=event, files=files,
                               obsolete=obsolete))

    def get_session(self, sid: str, then: Callable[[dict | None, dict | None, str], None]) -> None:
        """Look a session's record up; ``then(record or None, its state read back or None, why not)`` runs on the
        scheduler thread. Entries the record names that another pod wrote since the last scan are indexed first."""
        if not self.readable:
            then(None, None, "")
            return
        jid = next(self._ids)
        self.jobs[jid] = ("get_session", then)
        self.worker.submit(Job("get_session", jid, sid))

    def forget_session(self, sid: str) -> None:
        if self.readable:  # (a deletion frees room on a full directory)
            self.worker.submit(Job("delete_record", 0, sid))

    # ---- results (scheduler thread) -------------------------------------------------------------------
    def apply(self, res: Result) -> None:
        job = res.job
        ctx = self.jobs.pop(job.id, None)
        if res.fatal:
            self._degrade(res.reason)
        elif res.read_only and job.kind != "scan":
            self._refuse_writes(res.reason)
        if job.kind == "scan":
            self._apply_scan(res)
        elif job.kind == "write":
            _, lock, key = ctx
            self.writing.discard(key)
            self.pending_bytes -= self._estimate(key)
            if res.ok:
                self._add(job.name, key, res.bytes)
                lock.node.stored = True
                self.metrics.tier_bytes.labels("host_to_storage").inc(res.bytes)
                self.metrics.storage_write_seconds.observe(res.seconds)
            self.host.unlock(lock)
            self.unpin_kv(lock.kv)
        elif job.kind == "read":
            _, slot, ticket = ctx
            self.reads.pop(job.name, None)
            ticket.done = True
            kv = self.land_kv(ticket.key, res.state["k"], res.state["v"]) if res.ok and self.land_kv else None
            if res.ok and self.land_kv is not None and kv is None:
                self.host.release(slot)  # (hybrids) no KV pages for it now: the request computes the prefix
            elif res.ok:
                node = self.host.commit(ticket.key, slot)
                if node is not None:
                    node.stored, node.from_storage = True, True
                    if not ticket.released:
                        self.host.tree.lock(node)
                        ticket.lock, kv = HostLock(node, kv), None
                self.unpin_kv(kv)  # (a request that is not waiting any more: nothing holds it)
                self.metrics.tier_bytes.labels("storage_to_host").inc(res.bytes)
                self.metrics.storage_load_seconds.observe(res.seconds)
            else:
                self.host.release(slot)
                if res.reason in ("corrupt", "invalid", "incompatible"):
                    self.metrics.storage_rejected.labels(res.reason).inc()
                if res.reason in ("corrupt", "invalid", "incompatible", "missing") and job.name in self.by_name:
                    self._forget(self.by_name[job.name], delete=False)
        elif job.kind == "put_session":
            ctx[1](res.ok)
        elif job.kind == "get_session":
            for name, tokens, size, _ in res.entries:
                self._add(name, tokens, size)
            record = None
            if res.ok and res.data:
                try:
                    record = json.loads(res.data)
                except ValueError as e:  # (truncated by a crash, or damaged)
                    self.metrics.files_rejected.labels("record", "corrupt").inc()
                    log.warning("persisted session %s not restored (corrupt): its record is not JSON: %s", job.name, e)
            if res.state_error in ("corrupt", "invalid", "incompatible"):
                self.metrics.storage_rejected.labels(res.state_error).inc()
            ctx[1](record, res.state, res.state_error)

    def _apply_scan(self, res: Result) -> None:
        if not res.ok:
            return
        free, total = res.space
        if self.configured_capacity is None:
            self.capacity = default_capacity(self.used, free, total)
        if self.degraded:
            self.degraded = False
            log.warning("storage tier readable again")
        if res.read_only:
            self._refuse_writes(res.reason)
        elif self.read_only and free > MARGIN_FLOOR // 4:
            self.read_only = ""
            log.warning("storage tier writable again")
        self._set_gauges()
        for name in [n for n in self.by_name if n not in res.names]:
            self._forget(self.by_name[name], delete=False)  # another pod's LRU deleted it
        for name, reason in res.rejected:
            self.metrics.storage_rejected.labels(reason).inc()
        for name, tokens, size, _ in sorted(res.entries, key=lambda e: e[3]):  # oldest first: LRU by mtime
            if name not in self.by_name:
                self._add(name, tokens, size)
        self.session_bytes = res.session_bytes
        self._make_room(0)

    def _add(self, name: str, key: Sequence[int], size: int) -> None:
        if name in self.by_name:
            return
        eid = next(self._ids)
        ids = self._token_ids
        if not self.index.insert(tuple([ids.setdefault(t, t) for t in key]), eid).stored:
            return
        self.entries[eid] = _Entry(name, size)
        self.by_name[name] = eid
        self.used += size

    def _forget(self, eid: int, delete: bool) -> None:
        """Drop entry ``eid`` from the index (already evicted from the tree when ``delete``)."""
        e = self.entries.pop(eid)
        del self.by_name[e.name]
        self.used -= e.size
        if not delete:
            node = self.index._owner.get(eid)
            if node is not None and not node.lock_ref:
                self.index._drop(node)
        elif self.readable:
            self.worker.submit(Job("delete", 0, e.name))

    def _degrade(self, reason: str) -> None:
        if not self.degraded:
            self.degraded = True
            self._set_gauges()
            log.error("storage tier disabled: %s (requests are served from the device and host tiers; a later "
                      "scan re-enables it when the directory is usable)", reason)

    def _refuse_writes(self, reason: str) -> None:
        if not self.read_only:
            self.read_only = reason
            self._set_gauges()
            log.error("storage tier read-only: %s (its entries and persisted sessions are still read; nothing "
                      "more is written, session turns included, until a scan finds the directory writable)", reason)

    def _set_gauges(self) -> None:
        self.metrics.storage_degraded.set(int(self.degraded or bool(self.read_only)))
        self.metrics.storage_read_only.set(int(bool(self.read_only) and not self.degraded))

    @property
    def status(self) -> str:
        """What ``/health`` says of the tier: "" while it reads and writes."""
        if self.degraded:
            return "storage tier off (the directory is gone or unreadable); session turns are not persisted"
        if self.read_only:
            return (f"storage tier read-only ({self.read_only}): entries and sessions are still read, "
                    "session turns are not persisted")
        return ""

    # ---- life -----------------------------------------------------------------------------------------
    def rescan(self) -> None:
        """Look for entries other servers added or removed now, instead of at the next periodic scan."""
        self.worker.submit(Job("scan"))

    def drain(self, timeout: float = 60.0) -> None:
        """Wait for the jobs queued so far (a stopping server's writes reach the disk)."""
        if not self.worker.drain(timeout):
            log.warning("storage writes still running after %.0f s at shutdown", timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.worker.close(timeout)

    def update_gauges(self) -> None:
        m = self.metrics
        m.tier_used_bytes.labels("storage").set(self.used)
        m.tier_capacity_bytes.labels("storage").set(self.capacity)
        m.storage_entries.set(len(self.entries))
        if self.evictions:
            m.evictions.labels("storage").inc(self.evictions)
            self.evictions = 0

    def check_invariants(self) -> None:
        self.index.check_invariants()
        assert set(self.index.all_slots()) == set(self.entries), "storage index and entries disagree"
        assert self.used == sum(e.size for e in self.entries.values()), "storage bytes miscounted"
        assert {self.entries[i].name for i in self.entries} == set(self.by_name), "storage names miscounted"
        reading = {ctx[1] for ctx in self.jobs.values() if ctx[0] == "read"}
        assert reading == self.host.reserved, f"host slots reserved without a read: {self.host.reserved - reading}"
        writes = [ctx[2] for ctx in self.jobs.values() if ctx[0] == "write"]
        assert set(writes) <= self.writing, "a write not tracked"
        assert self.pending_bytes == sum(self._estimate(k) for k in writes), "room of writes in flight miscounted"
