"""Session headers, and who calls a session verb (``sessions.table.Caller``): the API key it authenticated
with, its address, the session secret it presents, and a fresh secret for a session it opens, returned in
the ``x-session-secret`` response header (docs/server-interface.md, "Session ownership").

The secret travels back as ``session_params.secret`` (the one field sglang-router forwards; it drops
request headers but returns response headers) or as the ``x-session-secret`` request header."""

from __future__ import annotations

import dataclasses
import secrets

from fastapi import Request

from mambaserve.server.sessions.table import Caller, TurnParams

SECRET_HEADER = "x-session-secret"
PERSISTED_HEADER = "x-session-persisted"
API_KEY_SCOPE = "mambaserve.api_key"  # the ASGI scope key auth.py sets: the fingerprint of the key used


def caller_of(request: Request, secret: str | None = None) -> Caller:
    return Caller(key=request.scope.get(API_KEY_SCOPE), address=request.client.host if request.client else None,
                  secret=secret or request.headers.get(SECRET_HEADER), new_secret=secrets.token_urlsafe(24))


def turn_with_caller(request: Request, session_id: str | None, turn: TurnParams | None,
                     secret: str | None = None) -> TurnParams | None:
    """A session turn's parameters with its caller (no session: unchanged)."""
    if session_id is None:
        return turn
    return dataclasses.replace(turn or TurnParams(), caller=caller_of(request, secret))


def session_headers(turn: TurnParams | None, gens: list) -> dict[str, str]:
    """The headers of an answer to a session turn: the secret of a session the turn opened, and with
    ``--session-persist``, once known (a non-streamed answer; a stream tells it in its last event), whether the
    turn was written to storage (``false``: the tier is read-only or off, a restart resumes the session from
    its last written turn)."""
    headers = {}
    if turn is not None and turn.open is not None:
        headers[SECRET_HEADER] = turn.caller.new_secret
    persisted = gens[0].req.persisted if turn is not None and len(gens) == 1 else None
    if persisted is not None:
        headers[PERSISTED_HEADER] = "true" if persisted else "false"
    return headers
