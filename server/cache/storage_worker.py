"""The storage tier's I/O thread: every disk (or volume) access of the L3 tier runs here.

Why a thread of its own: a snapshot of a 2.7b model is ~170 MB, a write or a read of it takes tens
to hundreds of milliseconds on a good disk and seconds on a network volume, and the scheduler thread
launches a decode step every few milliseconds. The scheduler only *decides* (which entry, which host
slot) and posts a job; this thread does the bytes and posts the result back into the scheduler's
inbox, where it is applied between two steps. One thread, one FIFO: jobs run in the order posted (a
session's state is written before the record that names it), and a slow volume delays only the
tier, never decoding. Python releases the GIL during file I/O and hashing of large buffers, so the
scheduler keeps running while this thread waits on the disk.

The host slots named by a job belong to the job until its result is applied: a write reads a host
slot the tier has locked, a read fills a host slot reserved for it (in no tree yet).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from mambaserve.server.cache import storage_entry as fmt
from mambaserve.server.cache.storage_backend import StorageBackend
from mambaserve.server.cache.storage_entry import EntryError

log = logging.getLogger(__name__)

READ_CHUNK = 16 * 2**20

@dataclass
class Job:
    kind: str  # write | read | delete | scan | put_session | get_session | delete_record
    id: int = 0
    name: str = ""
    tokens: tuple[int, ...] = ()
    host_slot: int = -1
    event: object | None = None  # a CUDA event: the host slot's contents are complete once it has passed
    data: bytes = b""
    kv: object | None = None  # (hybrids) write: the entry's KV (a prefix_cache.KVCopy, filled once event passed)
    files: list[SessionFile] = field(default_factory=list)  # put_session: written before the record
    obsolete: list[str] = field(default_factory=list)  # put_session: a session's files deleted after the record


@dataclass
class SessionFile:
    """One file of a persisted session (``put_session``): its state (``conv``, ``ssm``) after ``tokens``, or the KV
    of ``tokens[kv_from:]`` (``k``, ``v``: ``[n, La, Hkv, D]``); host tensors, complete once the job's event passed."""

    name: str
    tokens: list[int]
    parts: list[torch.Tensor]
    kv_from: int | None = None


@dataclass
class Result:
    job: Job
    ok: bool = True
    reason: str = ""  # a failed read: corrupt | incompatible | missing | io; a failed write: the OS error
    fatal: bool = False  # the directory is unusable (gone, unreadable): the tier degrades
    read_only: bool = False  # it refuses writes (full, quota, read-only filesystem): the tier only reads
    bytes: int = 0
    seconds: float = 0.0
    entries: list = field(default_factory=list)  # scan: (name, tokens, size, mtime) of entries not seen before
    names: set = field(default_factory=set)  # scan: every entry name present
    rejected: list = field(default_factory=list)  # scan: (name, reason) of entries found unusable
    space: tuple[int, int] = (0, 0)  # scan: (free, total) bytes
    session_bytes: int = 0  # scan: bytes of persisted sessions' records and files
    data: bytes | None = None  # get_session: the record's bytes
    state: dict | None = None  # read (hybrids): the entry's KV; get_session: the state its record names (host)
    state_error: str = ""  # get_session: why that state could not be read (a reason, as for entries)


# errors of a directory that can still be read but takes no more bytes: the tier goes on reading
NO_WRITES = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def _refused(job, e: OSError):
    """A write the directory refused: read-only for a full or read-only one, fatal otherwise."""
    full = e.errno in NO_WRITES
    return Result(job, ok=False, reason=e.strerror or type(e).__name__, fatal=not full, read_only=full)


class StorageWorker:
    """Runs jobs on one daemon thread; ``post(result)`` is called on that thread (make it thread-safe)."""

    def __init__(self, backend: StorageBackend, compat: dict, host_conv: torch.Tensor, host_ssm: torch.Tensor,
                 post: Callable[[Result], None], page_size: int = 1, rescan_s: float = 10.0, vocab: int = 2**63,
                 kv: tuple[tuple[int, int, int], torch.dtype] | None = None, session_expiry_s: float = float("inf")):
        self.backend, self.compat, self.page_size, self.vocab = backend, compat, page_size, vocab
        self.conv, self.ssm = host_conv, host_ssm
        self.state_shapes = {"conv": list(host_conv.shape[1:]), "ssm": list(host_ssm.shape[1:])}
        self.kv = kv  # hybrids: ((attention layers, KV heads, head dim), dtype) of one token's K (and V)
        # an entry's: the state, and a hybrid's KV of its tokens beside it
        self.shapes = {**self.state_shapes, **({"kv": list(kv[0])} if kv else {})}
        self.session_expiry_s = session_expiry_s  # records not written for this long are removed by scans
        self.post, self.rescan_s = post, rescan_s
        self.q: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._seen: dict[str, float] = {}  # entry name -> mtime whose header was read (scans read new ones only)
        self._thread = threading.Thread(target=self._loop, name="storage-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def run_now(self, job: Job) -> Result:
        """Run ``job`` on the calling thread (before ``start`` only: the first scan, at startup)."""
        return getattr(self, f"_{job.kind}")(job)

    def submit(self, job: Job) -> None:
        self.q.put(job)

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every job posted so far has run (writes are on disk); False on timeout."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        self.q.put(Job("barrier", event=done))
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the jobs posted so far (writes reach the disk), then stop."""
        if self._thread.is_alive():
            self.q.put(None)
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            try:
                job = self.q.get(timeout=self.rescan_s)
            except queue.Empty:
                job = Job("scan")  # another pod may have added or removed entries meanwhile
            if job is None:
                return
            try:
                result = getattr(self, f"_{job.kind}")(job)
            except Exception as e:  # a bug here must not kill the thread: the job fails, the tier goes on
                log.exception("storage job %s failed", job.kind)
                result = Result(job, ok=False, reason=type(e).__name__)
            if result is not None:
                self.post(result)

    # ---- jobs ---------------------------------------------------------------------------------------
    def _write(self, job: Job) -> Result:
        t = time.monotonic()
        job.name = job.name or fmt.entry_name(job.tokens, self.page_size)
        if job.event is not None:
            job.event.synchronize()  # the device-to-host copy of this slot has landed
        try:
            parts = [self.conv[job.host_slot], self.ssm[job.host_slot]] + ([job.kv.k, job.kv.v] if job.kv else [])
            size = self.backend.write(job.name, self._bytes(job.tokens, self.shapes, parts))
        except OSError as e:
            return _refused(job, e)
        return Result(job, bytes=size, seconds=time.monotonic() - t)

    def _bytes(self, tokens, shapes: dict, parts: list[torch.Tensor], **fields) -> list:
        """An entry's (or a session file's) chunks: header, the parts' bytes, the SHA-256 trailer."""
        views = [fmt.as_bytes(t.contiguous()) for t in parts]
        head = fmt.header_bytes(self.compat, tokens, self.page_size, shapes, sum(v.nbytes for v in views), **fields)
        h = hashlib.sha256(head)
        for v in views:
            h.update(v)
        return [head, *views, h.digest()]

    def _read(self, job: Job) -> Result:
        t = time.monotonic()
        kv = self._kv_buffers(len(job.tokens)) if self.kv else {}
        try:
            size = self._read_into(job, kv)
        except EntryError as e:
            if e.reason in ("corrupt", "invalid"):
                log.warning("storage entry %s is %s (%s): deleted", job.name, e.reason, e)
                self._delete(job)
            return Result(job, ok=False, reason=e.reason)
        except FileNotFoundError:
            return Result(job, ok=False, reason="missing")  # another pod's LRU deleted it meanwhile
        except OSError as e:
            log.warning("storage entry %s unreadable: %s", job.name, e)
            return Result(job, ok=False, reason="io")
        return Result(job, bytes=size, seconds=time.monotonic() - t, state=kv or None)

    def _read_into(self, job: Job, kv: dict) -> int:
        if job.event is not None:
            job.event.synchronize()  # no launched load still reads the reserved slot's old contents
        with self.backend.open(job.name) as f:
            return self._read_file(f, job.tokens, self.shapes,
                                   [self.conv[job.host_slot], self.ssm[job.host_slot], *kv.values()])

    def _kv_buffers(self, n: int) -> dict[str, torch.Tensor]:
        """Host tensors for the K and V of ``n`` tokens (``[n, La, Hkv, D]``; pinned where the host tier is)."""
        shape, dtype = self.kv
        k = torch.empty(n, *shape, dtype=dtype, pin_memory=self.conv.is_pinned())
        return {"k": k, "v": torch.empty_like(k, pin_memory=self.conv.is_pinned())}

    def _read_file(self, f, tokens, shapes: dict, parts: list[torch.Tensor], whole_pages: bool = True,
                   **fields) -> int:
        """Read an entry (or a session's file) into ``parts``: its header this model's (``shapes``), after exactly
        ``tokens``, with ``fields`` as given; its payload hashed as it comes, checked against the trailer, finite.
        EntryError with the reason otherwise; returns the bytes read."""
        first = f.read(12)
        span = fmt.header_span(first)
        if not span:
            raise EntryError("corrupt", "bad magic")
        prefix = first + f.read(span - len(first))
        header, _ = fmt.parse_header(prefix)
        fmt.check_compatible(header, self.compat)
        fmt.check_contents(header, self.vocab, self.page_size, shapes, whole_pages)
        if tuple(header["tokens"]) != tuple(tokens) or any(header.get(k) != v for k, v in fields.items()):
            raise EntryError("corrupt", "its tokens or fields do not match its name")
        views = [fmt.as_bytes(t) for t in parts]
        if header.get("payload_bytes") != sum(v.nbytes for v in views):
            raise EntryError("incompatible", "state size differs")
        h = hashlib.sha256(prefix)
        for view in views:  # straight into place, hashed as it comes
            pos = 0
            while pos < view.nbytes:
                n = f.readinto(view[pos:pos + READ_CHUNK])
                if not n:
                    raise EntryError("corrupt", "truncated payload")
                h.update(view[pos:pos + n])
                pos += n
        trailer = f.read(fmt.CHECKSUM_BYTES + 1)
        if trailer != h.digest():
            raise EntryError("corrupt", "checksum mismatch" if len(trailer) == fmt.CHECKSUM_BYTES
                             else "truncated or overlong")
        if not all(torch.isfinite(t).all() for t in parts):
            raise EntryError("invalid", "its state is not finite")
        return len(prefix) + sum(v.nbytes for v in views) + len(trailer)

    def _barrier(self, job: Job) -> None:
        job.event.set()  # every job posted before it has run

    def _delete(self, job: Job) -> None:
        try:
            self.backend.delete(job.name)
        except OSError as e:
            log.debug("storage entry %s not deleted: %s", job.name, e)
        self._seen.pop(job.name, None)

    def _scan(self, job: Job) -> Result:
        """Every entry present, and the tokens of those not seen before (their headers only). A directory
        that refuses the probe's write but can be listed (full, read-only) is scanned all the same, read-only:
        what is on it can still be read (a restart on a full volume)."""
        res = Result(job)
        try:
            try:
                self.backend.probe()
            except OSError as e:
                if e.errno not in NO_WRITES:
                    raise
                res.read_only, res.reason = True, e.strerror or type(e).__name__
            res.space = self.backend.space()
            listing = list(self.backend.list())
        except OSError as e:
            return Result(job, ok=False, reason=e.strerror or type(e).__name__, fatal=True)
        for name, size, mtime in listing:
            res.names.add(name)
            if self._seen.get(name) == mtime:
                continue
            self._seen[name] = mtime
            try:
                tokens = self._entry_tokens(name)
            except EntryError as e:
                res.rejected.append((name, e.reason))
                if e.reason in ("corrupt", "invalid"):
                    self._delete(Job("delete", name=name))
                    res.names.discard(name)
                continue
            except OSError:
                self._seen.pop(name, None)
                res.names.discard(name)
                continue
            res.entries.append((name, tokens, size, mtime))
        for gone in set(self._seen) - res.names:
            del self._seen[gone]
        try:
            res.session_bytes = self.backend.sessions(time.time() - self.session_expiry_s)
        except OSError:
            pass
        return res

    def _entry_tokens(self, name: str) -> tuple[int, ...]:
        """Entry ``name``'s tokens from its header, which a read would accept (EntryError or OSError if not)."""
        with self.backend.open(name) as f:
            first = f.read(12)
            header, _ = fmt.parse_header(first + f.read(max(0, fmt.header_span(first) - len(first))))
        fmt.check_compatible(header, self.compat)
        fmt.check_contents(header, self.vocab, self.page_size, self.shapes)
        if fmt.entry_name(header["tokens"], self.page_size) != name:
            raise EntryError("corrupt", "name does not match the tokens")
        return tuple(header["tokens"])

    # ---- persisted sessions ---------------------------------------------------------------------------
    def _put_session(self, job: Job) -> Result:
        """A session's files (its state, its new KV), then its record naming them, then the files it no longer
        names: a reader finds a record only with every file it names, whenever this stops."""
        t = time.monotonic()
        if job.event is not None:
            job.event.synchronize()  # the copies from the device have landed
        size = 0
        try:
            for f in job.files:
                shapes = self.state_shapes if f.kv_from is None else {"kv": list(self.kv[0])}
                fields = {} if f.kv_from is None else {"kv_from": f.kv_from}
                size += self.backend.put_session_file(job.name, f.name, self._bytes(f.tokens, shapes, f.parts, **fields))
            self.backend.put_record(job.name, job.data)
        except OSError as e:
            return _refused(job, e)
        for name in job.obsolete:
            try:
                self.backend.delete_session_file(job.name, name)
            except OSError:
                pass
        return Result(job, bytes=size + len(job.data), seconds=time.monotonic() - t)

    def _get_session(self, job: Job) -> Result:
        """A session's record and what it names: a streaming session's state and KV files read into new host
        tensors (``Result.state``), a non-streaming one's turn states found in the entries (``Result.entries``,
        as a scan reports them: another pod wrote them since this one's last scan)."""
        t = time.monotonic()
        res = self._get_record(job)
        if not res.ok or not res.data:
            return res
        try:
            record = json.loads(res.data)
        except ValueError:
            return res  # (the scheduler reports it)
        if not isinstance(record, dict):
            return res
        try:
            if record.get("streaming") is True:
                res.state = self._session_state(job.name, record)
            else:
                res.entries = self._turn_entries(record)
        except EntryError as e:
            res.state_error = e.reason
            log.warning("persisted session %s: its state is not loaded (%s): %s", job.name, e.reason, e)
        except OSError as e:
            res.state_error = "missing" if isinstance(e, FileNotFoundError) else "io"
            log.warning("persisted session %s: its state is not loaded: %s", job.name, e)
        res.seconds = time.monotonic() - t
        return res

    def _session_state(self, sid: str, record: dict) -> dict | None:
        """The state file and KV files a streaming session's record names, read and checked."""
        history, n, chunks = record.get("history"), record.get("state"), record.get("kv", [])
        if not (isinstance(history, list) and type(n) is int and 0 < n <= len(history)):
            return None  # (a record without a state: its history is recomputed)
        pin = self.conv.is_pinned()
        state = {"conv": torch.empty(self.conv.shape[1:], dtype=self.conv.dtype, pin_memory=pin),
                 "ssm": torch.empty(self.ssm.shape[1:], dtype=self.ssm.dtype, pin_memory=pin)}
        with self.backend.open_session_file(sid, f"{n}.state") as f:
            self._read_file(f, history[:n], self.state_shapes, [state["conv"], state["ssm"]], whole_pages=False)
        if self.kv is None:
            return state
        if not _covers(chunks, n):
            raise EntryError("invalid", f"its KV files {chunks!r} do not cover its {n} tokens")
        state |= self._kv_buffers(n)  # (token-major: a file's tokens are one block)
        for a, b in chunks:
            with self.backend.open_session_file(sid, f"{a}-{b}.kv") as f:
                self._read_file(f, history[:b], {"kv": self.shapes["kv"]}, [state["k"][a:b], state["v"][a:b]],
                                whole_pages=False, kv_from=a)
        return state

    def _turn_entries(self, record: dict) -> list:
        """The entries holding a non-streaming session's turn states, as (name, tokens, size, mtime)."""
        out = []
        for turn in record.get("turns") or []:
            tokens, n = (turn.get("tokens"), turn.get("state")) if isinstance(turn, dict) else (None, None)
            if not (isinstance(tokens, list) and type(n) is int and 0 < n <= len(tokens)):
                continue
            name = fmt.entry_name(tokens[:n], self.page_size)
            try:
                if self._entry_tokens(name) == tuple(tokens[:n]):
                    out.append((name, tuple(tokens[:n]), self.backend.size(name), 0.0))
            except (EntryError, OSError):
                continue  # (a read would refuse it the same way: the turn recomputes)
        return out

    def _get_record(self, job: Job) -> Result:
        try:
            return Result(job, data=self.backend.get_record(job.name))
        except OSError as e:
            return Result(job, ok=False, reason=e.strerror or type(e).__name__)

    def _delete_record(self, job: Job) -> None:
        try:
            self.backend.delete_record(job.name)
        except OSError:
            pass


def _covers(chunks: object, n: int) -> bool:
    """``chunks`` ([a, b] token ranges, in order) cover tokens [0, n) without a gap or an overlap."""
    end = 0
    for c in chunks if isinstance(chunks, list) else [None]:
        if not (isinstance(c, list) and len(c) == 2 and c[0] == end and type(c[1]) is int and c[1] > end):
            return False
        end = c[1]
    return end == n
