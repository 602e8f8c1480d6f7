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
                 directory: Path, compat: dict):
        self.sessions, self.cache, self.runner, self.metrics = sessions, cache, runner, metrics
        self.directory, self.compat = directory, compat

    def save(self, sid: str, name: str | None) -> dict:
        s, tokens, meta = self.sessions.export(sid)
        path = snapshot.snapshot_path(self.directory, name or f"{sid}.safetensors")
        state = None
        if s.slot is not None:
            self.runner.apply_state_ops(self.cache.take_pending())
            state = self.runner.read_slot(s.slot)
        size = snapshot.write(path, self.compat, meta, tokens, state)
        return {"path": str(path), "name": path.name, "bytes": size, "tokens": len(tokens),
                "has_state": state is not None}

    def restore(self, name: str, session_id: str | None) -> dict:
        meta, tokens, state = snapshot.read(snapshot.snapshot_path(self.directory, name), self.compat)
        slot = None
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
