"""A session's tokens and live state to a snapshot file and back (``/sessions/{id}/snapshot``, ``/sessions/restore``).

Runs on the scheduler thread between steps: the session manager says what a session holds, the
model runner reads or writes its slot (after the deferred state ops, so no stale copy lands on it),
``sessions.snapshot`` owns the file format.
"""

from __future__ import annotations

from pathlib import Path

from mambaserve.server.cache.prefix_cache import DisabledCache
from mambaserve.server.engine.metrics import ServerMetrics
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.sessions import snapshot
from mambaserve.server.sessions.manager import SessionManager
from mambaserve.server.sessions.table import SessionError


class SessionFiles:
    def __init__(self, sessions: SessionManager, cache: DisabledCache, runner: ModelRunner, metrics: ServerMetrics,
                 directory: Path, compat: dict, max_bytes: int, max_per_session: int, states: bool = True):
        self.sessions, self.cache, self.runner, self.metrics = sessions, cache, runner, metrics
        # hybrid models: a file keeps the tokens only (a live state is worthless without its KV pages, which
        # stay on the device); the restored session's next turn prefills its history through the cache
        self.states = states
        self.directory, self.compat = directory, compat
        self.max_bytes, self.max_per_session = max_bytes, max_per_session

    def save(self, sid: str, name: str | None) -> dict:
        """Write the session's file. A file of another session is never overwritten; each session may
        keep ``max_per_session`` files and the directory ``max_bytes`` in all."""
        s, tokens, meta = self.sessions.export(sid)
        path = snapshot.snapshot_path(self.directory, name or f"{sid}.safetensors")
        exists = path.is_file()
        if exists and snapshot.owner(path) != sid:
            raise SessionError(409, f"snapshot {path.name!r} belongs to another session; choose another name",
                               "snapshot_exists")
        total, per_session = snapshot.usage(self.directory)
        if not exists and per_session.get(sid, 0) >= self.max_per_session:
            raise SessionError(429, f"session {sid!r} has {self.max_per_session} snapshots already "
                               "(--session-snapshot-max-per-session); overwrite one by its name", "snapshot_quota")
        state = None
        if not self.states:
            meta = {**meta, "in_state": 0}
        elif s.slot is not None:
            self.runner.apply_state_ops(self.cache.take_pending())
            state = self.runner.read_slot(s.slot)
        size = snapshot.estimate_bytes(tokens, state)
        if total - (path.stat().st_size if exists else 0) + size > self.max_bytes:
            raise SessionError(507, f"the snapshot directory would exceed its quota of {self.max_bytes} bytes "
                               "(--session-snapshot-max-bytes)", "snapshot_quota")
        size = snapshot.write(path, self.compat, meta, tokens, state)
        return {"name": path.name, "bytes": size, "tokens": len(tokens), "has_state": state is not None}

    def restore(self, name: str, session_id: str | None) -> dict:
        meta, tokens, state = snapshot.read(snapshot.snapshot_path(self.directory, name), self.compat)
        slot = None
        if not self.states:
            state = None
        if state is not None:
            if not self.runner.fits_slot(state):
                raise SessionError(409, "snapshot state shapes do not match this model", "snapshot_incompatible")
            slot = self.cache.alloc()
            if slot is None:
                raise SessionError(503, "no free state slot to restore the session into; retry later", "no_capacity")
        try:
            s = self.sessions.restore(meta, tokens, session_id, slot)
        except SessionError:
            if slot is not None:
                self.cache.free(slot)
            raise
        if slot is not None:
            self.runner.apply_state_ops(self.cache.take_pending())  # a stale deferred op must not land on it
            self.runner.write_slot(slot, state)
        self.metrics.session_restores.inc()
        return {"session_id": s.id, "tokens": len(tokens), "has_state": slot is not None}
