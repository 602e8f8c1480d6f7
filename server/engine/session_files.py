"""A session's tokens and live state out of the scheduler for a snapshot file, and back in from one
(``/sessions/{id}/snapshot``, ``/sessions/restore``).

Only the parts that touch the scheduler's data run on its thread, between steps, and neither touches a
file: ``export`` (the session's fields and a copy of its live state, queued on the device) and ``restore``
(a slot for a file's state, the session recreated). The files themselves, quotas and the directory's
index are ``sessions.snapshot_store``'s, on its own thread; ``Engine`` chains the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mambaserve.server.cache.prefix_cache import DisabledCache
from mambaserve.server.engine.metrics import ServerMetrics
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.sessions.manager import SessionManager
from mambaserve.server.sessions.table import Caller, SessionError


@dataclass
class Exported:
    """What a snapshot file keeps of a session: its tokens, fields and live state (host tensors, complete once
    ``ready`` has passed: a CUDA event, None on the CPU)."""

    tokens: list[int]
    meta: dict
    state: dict[str, torch.Tensor] | None
    ready: object | None = None


class SessionFiles:
    def __init__(self, sessions: SessionManager, cache: DisabledCache, runner: ModelRunner, metrics: ServerMetrics,
                 states: bool = True):
        self.sessions, self.cache, self.runner, self.metrics = sessions, cache, runner, metrics
        # hybrid models: a file keeps the tokens only (a live state is worthless without its KV pages, which
        # stay on the device); the restored session's next turn prefills its history through the cache
        self.states = states

    def export(self, sid: str, caller: Caller = Caller()) -> Exported:
        """The session between turns, its state copied to the host without waiting for the device."""
        s, tokens, meta = self.sessions.export(sid, caller)
        if not self.states:
            return Exported(list(tokens), {**meta, "in_state": 0}, None)
        if s.slot is None:
            return Exported(list(tokens), meta, None)
        self.runner.apply_state_ops(self.cache.take_pending())  # a deferred copy into its slot runs first
        state, ready = self.runner.copy_out(s.slot)
        return Exported(list(tokens), meta, state, ready)

    def restore(self, meta: dict, tokens: list[int], state: dict[str, torch.Tensor] | None,
                session_id: str | None, caller: Caller = Caller()) -> dict:
        """Recreate a session from a file's verified contents (``SnapshotStore.load``); with ``new_secret`` when
        the file had no owner and the session took the caller's new secret."""
        slot = None
        if not self.states:
            state = None
        if state is not None:
            slot = self.cache.alloc()
            if slot is None:
                raise SessionError(503, "no free state slot to restore the session into; retry later", "no_capacity")
        try:
            s = self.sessions.restore(meta, tokens, session_id, slot, caller)
        except SessionError:
            if slot is not None:
                self.cache.free(slot)
            raise
        if slot is not None:
            self.runner.apply_state_ops(self.cache.take_pending())  # a stale deferred op must not land on it
            self.runner.write_slot(slot, state)
        self.metrics.session_restores.labels("loaded" if slot is not None else "recomputed").inc()
        out = {"session_id": s.id, "tokens": len(tokens), "has_state": slot is not None}
        if caller.new_secret and not meta.get("owner"):
            out["new_secret"] = True  # the file had no owner: the session took the caller's new secret
        return out
