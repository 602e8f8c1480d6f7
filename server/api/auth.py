"""API key check (ASGI middleware): every endpoint but ``/health`` and ``/metrics`` needs
``Authorization: Bearer <key>`` when the server has a key (``--api-key``, ``--api-key-file`` or the
``MAMBASERVE_API_KEY`` environment variable). Probes and scrapers stay open; everything that reads or
changes state (generation, sessions, snapshots, flush, abort) does not. With several keys (one per line
of ``--api-key-file``) each is a client: the key's fingerprint goes into the ASGI scope for session
ownership and quotas (``api.ownership``)."""

from __future__ import annotations

import hashlib
import hmac
import json

from mambaserve.server.api.ownership import API_KEY_SCOPE

OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyAuth:
    def __init__(self, app, keys: tuple[str, ...], on_reject=lambda: None):
        self.app, self.on_reject = app, on_reject
        self._keys = [(k.encode(), hashlib.sha256(k.encode()).hexdigest()[:16]) for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        fingerprint = self._fingerprint(scope)
        if fingerprint is not None:
            scope[API_KEY_SCOPE] = fingerprint
            return await self.app(scope, receive, send)
        self.on_reject()
        body = json.dumps({"error": {"message": "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                     "type": "authentication_error", "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _fingerprint(self, scope) -> str | None:
        """The fingerprint of the key the request carries, None if it carries none of ours."""
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        found = None
        for key, fingerprint in self._keys:  # every key compared: the time taken does not tell which matched
            if hmac.compare_digest(token.strip(), key) and scheme.lower() == b"bearer":
                found = fingerprint
        return found
