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

import hashlib
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
    kind: str  # write | read | delete | scan | put_record | get_record | delete_record
    id: int = 0
    name: str = ""
    tokens: tuple[int, ...] = ()
    host_slot: int = -1
    event: object | None = None  # a CUDA event: the host slot's contents are complete once it has passed
    data: bytes = b""


@dataclass
class Result:
    job: Job
    ok: bool = True
    reason: str = ""  # a failed read: corrupt | incompatible | missing | io; a failed write: the OS error
    fatal: bool = False  # the directory is unusable (full, read-only, gone): the tier degrades
    bytes: int = 0
    seconds: float = 0.0
    entries: list = field(default_factory=list)  # scan: (name, tokens, size, mtime) of entries not seen before
    names: set = field(default_factory=set)  # scan: every entry name present
    rejected: list = field(default_factory=list)  # scan: (name, reason) of entries found unusable
    space: tuple[int, int] = (0, 0)  # scan: (free, total) bytes
    data: bytes | None = None  # get_record


class StorageWorker:
    """Runs jobs on one daemon thread; ``post(result)`` is called on that thread (make it thread-safe)."""

    def __init__(self, backend: StorageBackend, compat: dict, host_conv: torch.Tensor, host_ssm: torch.Tensor,
                 post: Callable[[Result], None], page_size: int = 1, rescan_s: float = 10.0, vocab: int = 2**63):
        self.backend, self.compat, self.page_size, self.vocab = backend, compat, page_size, vocab
        self.conv, self.ssm = host_conv, host_ssm
        self.shapes = {"conv": list(host_conv.shape[1:]), "ssm": list(host_ssm.shape[1:])}
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
        conv, ssm = fmt.as_bytes(self.conv[job.host_slot]), fmt.as_bytes(self.ssm[job.host_slot])
        head = fmt.header_bytes(self.compat, job.tokens, self.page_size, self.shapes, conv.nbytes + ssm.nbytes)
        h = hashlib.sha256(head)
        h.update(conv)
        h.update(ssm)
        try:
            size = self.backend.write(job.name, [head, conv, ssm, h.digest()])
        except OSError as e:
            return Result(job, ok=False, reason=e.strerror or type(e).__name__, fatal=True)
        return Result(job, bytes=size, seconds=time.monotonic() - t)

    def _read(self, job: Job) -> Result:
        t = time.monotonic()
        try:
            size = self._read_into(job)
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
        return Result(job, bytes=size, seconds=time.monotonic() - t)

    def _read_into(self, job: Job) -> int:
        if job.event is not None:
            job.event.synchronize()  # no launched load still reads the reserved slot's old contents
        with self.backend.open(job.name) as f:
            first = f.read(12)
            span = fmt.header_span(first)
            if not span:
                raise EntryError("corrupt", "bad magic")
            prefix = first + f.read(span - len(first))
            header, _ = fmt.parse_header(prefix)
            fmt.check_compatible(header, self.compat)
            fmt.check_contents(header, self.vocab, self.page_size, self.shapes)
            if tuple(header["tokens"]) != tuple(job.tokens):
                raise EntryError("corrupt", "tokens do not match the entry's name")
            conv, ssm = fmt.as_bytes(self.conv[job.host_slot]), fmt.as_bytes(self.ssm[job.host_slot])
            if header.get("payload_bytes") != conv.nbytes + ssm.nbytes:
                raise EntryError("incompatible", "state size differs")
            h = hashlib.sha256(prefix)
            for view in (conv, ssm):  # straight into the reserved host slot, hashed as it comes
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
            if not (torch.isfinite(self.conv[job.host_slot]).all() and torch.isfinite(self.ssm[job.host_slot]).all()):
                raise EntryError("invalid", "its state is not finite")
            return len(prefix) + conv.nbytes + ssm.nbytes + len(trailer)

    def _barrier(self, job: Job) -> None:
        job.event.set()  # every job posted before it has run

    def _delete(self, job: Job) -> None:
        try:
            self.backend.delete(job.name)
        except OSError as e:
            log.debug("storage entry %s not deleted: %s", job.name, e)
        self._seen.pop(job.name, None)

    def _scan(self, job: Job) -> Result:
        """Every entry present, and the tokens of those not seen before (their headers only)."""
        res = Result(job)
        try:
            self.backend.probe()
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
                with self.backend.open(name) as f:
                    first = f.read(12)
                    span = fmt.header_span(first)
                    header, _ = fmt.parse_header(first + f.read(max(0, span - len(first))))
                fmt.check_compatible(header, self.compat)
                fmt.check_contents(header, self.vocab, self.page_size, self.shapes)
                if fmt.entry_name(header["tokens"], self.page_size) != name:
                    raise EntryError("corrupt", "name does not match the tokens")
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
            res.entries.append((name, tuple(header["tokens"]), size, mtime))
        for gone in set(self._seen) - res.names:
            del self._seen[gone]
        return res

    def _put_record(self, job: Job) -> Result:
        try:
            self.backend.put_record(job.name, job.data)
        except OSError as e:
            return Result(job, ok=False, reason=e.strerror or type(e).__name__, fatal=True)
        return Result(job)

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
