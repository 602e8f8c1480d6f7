"""Where L3 entries live: a small backend interface and its filesystem implementation.

The storage worker is the only caller (never the scheduler thread: every method here may block on
disk or network I/O). A backend stores opaque named blobs written atomically: readers see a whole
blob or none. Another backend (an object store) implements the same methods.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
import time
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Protocol

from mambaserve.server.cache.storage_entry import entry_path

STALE_TMP_S = 3600.0  # a temp file this old belongs to a writer that died: removed by scans


class StorageBackend(Protocol):
    def write(self, name: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Store the blob ``name`` atomically (replacing one of that name); returns its size."""

    def open(self, name: str) -> BinaryIO:
        """The blob for reading; FileNotFoundError when there is none."""

    def delete(self, name: str) -> None:
        """Remove ``name`` (no error if it is gone already)."""

    def size(self, name: str) -> int:
        """``name``'s size in bytes; FileNotFoundError when there is none."""

    def list(self) -> Iterator[tuple[str, int, float]]:
        """Every blob: (name, size in bytes, last modification time)."""

    def space(self) -> tuple[int, int]:
        """(free bytes, total bytes) of what holds the blobs."""

    def probe(self) -> None:
        """Raise OSError unless a blob can be written and removed now."""

    # session records: small documents by key, written atomically too, and the files a record names (its
    # state, its KV), each by a name of its own under the key
    def put_record(self, key: str, data: bytes) -> None: ...

    def get_record(self, key: str) -> bytes | None: ...

    def delete_record(self, key: str) -> None:
        """The record and every file of ``key``."""

    def put_session_file(self, key: str, name: str, chunks: Iterable[bytes | memoryview]) -> int: ...

    def open_session_file(self, key: str, name: str) -> BinaryIO: ...

    def delete_session_file(self, key: str, name: str) -> None: ...

    def sessions(self, expire_before: float) -> int:
        """Remove the records last written before ``expire_before`` (a time.time()) with their files (sessions
        nobody continued within their longest timeout); returns the bytes of the rest."""


class FileSystemBackend:
    """Blobs as files under ``root/entries/ab/<name>.l3`` (local disk, or a volume shared by pods).

    Atomic by temp file + rename in the same directory: a crash leaves a temp file (removed by a later
    scan), never a half-written entry under its real name. No fsync: a power loss can leave a renamed
    file with missing bytes, which its checksum then rejects as corrupt (an fsync per entry would cost
    more than the rare recompute)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._seq = 0
        self._lock = threading.Lock()

    def _tmp(self, path: Path) -> Path:
        with self._lock:
            self._seq += 1
            return path.with_name(f".{path.name}.{os.getpid()}.{self._seq}.tmp")

    def write(self, name: str, chunks: Iterable[bytes | memoryview]) -> int:
        path = entry_path(self.root, name)
        # never parents=True: a volume that went away must fail the write, not be recreated on local disk
        path.parent.parent.mkdir(exist_ok=True)
        path.parent.mkdir(exist_ok=True)
        return self._write_atomic(path, chunks)

    def _write_atomic(self, path: Path, chunks: Iterable[bytes | memoryview]) -> int:
        tmp = self._tmp(path)
        size = 0
        try:
            with open(tmp, "wb") as f:
                for c in chunks:
                    f.write(c)
                    size += len(c) if isinstance(c, bytes) else c.nbytes
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return size

    def open(self, name: str) -> BinaryIO:
        return open(entry_path(self.root, name), "rb")

    def delete(self, name: str) -> None:
        entry_path(self.root, name).unlink(missing_ok=True)

    def size(self, name: str) -> int:
        return entry_path(self.root, name).stat().st_size

    def list(self) -> Iterator[tuple[str, int, float]]:
        top = self.root / "entries"
        if not self.root.is_dir():
            raise FileNotFoundError(f"storage directory {self.root} is gone")
        if not top.is_dir():
            return
        now = time.time()
        for sub in os.scandir(top):
            if not sub.is_dir():
                continue
            for e in os.scandir(sub.path):
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue  # deleted meanwhile (another pod's LRU)
                if e.name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_TMP_S:
                        Path(e.path).unlink(missing_ok=True)
                elif e.name.endswith(".l3"):
                    yield e.name[:-3], st.st_size, st.st_mtime

    def space(self) -> tuple[int, int]:
        u = shutil.disk_usage(self.root)
        return u.free, u.total

    def probe(self) -> None:
        # no mkdir: a volume that went away must not be replaced by a directory on the node's own disk
        if not self.root.is_dir():
            raise FileNotFoundError(2, "storage directory is gone", str(self.root))
        probe = self.root / f".probe.{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()

    def _record_path(self, key: str, name: str = "json") -> Path:
        # not "sessions": the operator points --session-snapshot-dir at STORAGE_PATH/sessions
        return self.root / "session-records" / f"{record_stem(key)}.{name}"

    def put_record(self, key: str, data: bytes) -> None:
        path = self._record_path(key)
        path.parent.mkdir(exist_ok=True)
        self._write_atomic(path, [data])

    def get_record(self, key: str) -> bytes | None:
        try:
            return self._record_path(key).read_bytes()
        except FileNotFoundError:
            return None

    def delete_record(self, key: str) -> None:
        self._delete_stem(record_stem(key))

    def _delete_stem(self, stem: str) -> None:
        (self.root / "session-records" / f"{stem}.json").unlink(missing_ok=True)  # the record first
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.root / "session-records"):
                if e.name.lstrip(".").startswith(stem + "."):  # (a temp file a writer left too)
                    Path(e.path).unlink(missing_ok=True)

    def put_session_file(self, key: str, name: str, chunks: Iterable[bytes | memoryview]) -> int:
        path = self._record_path(key, name)
        path.parent.mkdir(exist_ok=True)
        return self._write_atomic(path, chunks)

    def open_session_file(self, key: str, name: str) -> BinaryIO:
        return open(self._record_path(key, name), "rb")

    def delete_session_file(self, key: str, name: str) -> None:
        self._record_path(key, name).unlink(missing_ok=True)

    def sessions(self, expire_before: float) -> int:
        stems: dict[str, list] = {}  # key hash -> [bytes, newest mtime]
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.root / "session-records"):
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                seen = stems.setdefault(e.name.lstrip(".").split(".", 1)[0], [0, 0.0])
                seen[0] += st.st_size
                seen[1] = max(seen[1], st.st_mtime)
        for stem, (_, newest) in list(stems.items()):
            if newest < expire_before:  # (files a record never came to name expire the same way)
                self._delete_stem(stem)
                del stems[stem]
        return sum(size for size, _ in stems.values())


def record_stem(key: str) -> str:
    """The file name (less its suffix) of session ``key``'s record and files."""
    return hashlib.sha256(key.encode()).hexdigest()[:40]
