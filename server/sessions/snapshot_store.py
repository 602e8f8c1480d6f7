"""The session snapshot directory on a thread of its own: file writes, reads, quotas and an index of its files.

Why a thread: a snapshot file takes milliseconds to seconds to write or read (a 2.7b model's state is ~170 MB,
a network volume is slow), and quotas need every file's owner and size. Done on the scheduler thread
(before), each snapshot read the header of every file in the directory: at 4,000 files a snapshot took ~1 s
and a neighbour's stream stalled as long (benchmarks/snapshot_stall.py). Here one worker thread owns the
directory and runs its jobs in the order they come (no locks: only it touches the index), and the
scheduler thread only copies a session's state out or into its slot.

The index (name -> owner session, bytes) is built by one scan, then kept by the worker's own writes; when the
directory's mtime shows that another process (a second server on a shared volume) added, replaced or removed
files, the listing is read again and only new or changed files' headers are read.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mambaserve.server.sessions import snapshot
from mambaserve.server.sessions.table import SessionError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _File:
    owner: str | None  # ``snapshot.owner_of`` its header's session (None: unreadable)
    size: int
    mtime_ns: int


class SnapshotStore:
    """``max_bytes``: the directory's quota in all; ``max_per_session``: files one session (one opening of it) may
    keep (overwriting its own by name is always allowed). Every method returns a Future; the work runs on the store's thread."""

    def __init__(self, directory: Path, compat: dict, max_bytes: int, max_per_session: int):
        self.directory, self.compat = Path(directory), compat
        self.max_bytes, self.max_per_session = max_bytes, max_per_session
        self._files: dict[str, _File] = {}
        self._dir_mtime: int | None = None  # the directory's mtime when the index was last made true
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="session-files")

    def save(self, sid: str, name: str, tokens: list[int], meta: dict, state: dict[str, torch.Tensor] | None,
             ready: object | None = None) -> concurrent.futures.Future:
        """Write session ``sid``'s file ``name`` (the result: name, bytes, tokens, has_state). ``ready``: a CUDA
        event after which ``state`` (host tensors copied from the device) is complete."""
        return self._worker.submit(self._save, sid, name, tokens, meta, state, ready)

    def load(self, name: str, check: Callable[[dict, list[int], dict | None], None] = lambda *_: None
             ) -> concurrent.futures.Future:
        """Read and verify file ``name``: (session fields, tokens, state or None). ``check`` refuses contents
        this server cannot use (raises SnapshotError)."""
        return self._worker.submit(self._load, name, check)

    def run(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """``fn()`` on the store's thread, after the jobs before it."""
        return self._worker.submit(fn)

    # ---- the worker thread ------------------------------------------------------------------------------
    def _save(self, sid: str, name: str, tokens: list[int], meta: dict, state, ready) -> dict:
        path = snapshot.snapshot_path(self.directory, name)
        self._refresh()
        mine, owner = self._files.get(path.name), snapshot.owner_of(meta)  # (a reopened id: another owner)
        if mine is not None and mine.owner != owner:
            raise SessionError(409, f"snapshot {path.name!r} belongs to another session; choose another name",
                               "snapshot_exists")
        if mine is None and sum(f.owner == owner for f in self._files.values()) >= self.max_per_session:
            raise SessionError(429, f"session {sid!r} has {self.max_per_session} snapshots already "
                               "(--session-snapshot-max-per-session); overwrite one by its name", "snapshot_quota")
        total = sum(f.size for f in self._files.values())
        if total - (mine.size if mine else 0) + snapshot.estimate_bytes(tokens, state) > self.max_bytes:
            raise SessionError(507, f"the snapshot directory would exceed its quota of {self.max_bytes} bytes "
                               "(--session-snapshot-max-bytes)", "snapshot_quota")
        if ready is not None:
            ready.synchronize()  # the state's copy from the device has landed
        size = snapshot.write(path, self.compat, meta, tokens, state)
        self._files[path.name] = _File(owner, size, path.stat().st_mtime_ns)
        self._dir_mtime = self._mtime()  # (this write's own change)
        return {"name": path.name, "bytes": size, "tokens": len(tokens), "has_state": state is not None}

    def _load(self, name: str, check) -> tuple[dict, list[int], dict | None]:
        meta, tokens, state = snapshot.read(snapshot.snapshot_path(self.directory, name), self.compat)
        check(meta, tokens, state)
        return meta, tokens, state

    def _mtime(self) -> int | None:
        try:
            return os.stat(self.directory).st_mtime_ns
        except OSError:
            return None

    def _refresh(self) -> None:
        """Make the index true if the directory changed since (another process); headers of new files only."""
        mtime = self._mtime()
        if mtime is not None and mtime == self._dir_mtime:
            return
        files: dict[str, _File] = {}
        if mtime is not None:
            for entry in os.scandir(self.directory):
                if entry.name.endswith(".tmp") or not entry.is_file():
                    continue
                st = entry.stat()
                known = self._files.get(entry.name)
                if known is None or known.mtime_ns != st.st_mtime_ns or known.size != st.st_size:
                    known = _File(snapshot.owner(Path(entry.path)), st.st_size, st.st_mtime_ns)
                files[entry.name] = known
        self._files, self._dir_mtime = files, mtime
