"""API key check (ASGI middleware): every endpoint but ``/health`` and ``/metrics`` needs
``Authorization: Bearer <key>`` when the server has a key (``--api-key``, ``--api-key-file`` or the
``MAMBASERVE_API_KEY`` environment variable). Probes and scrapers stay open; everything that reads or
changes state (generation, sessions, snapshots, flush, abort) does not."""

from __future__ import annotations

import hmac
import json

OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyAuth:
    def __init__(self, app, key: str, on_reject=lambda: None):
        self.app, self._key, self.on_reject = app, key.encode(), on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        self.on_reject()
        body = json.dumps({"error": {"message": "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                     "type": "authentication_error", "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
