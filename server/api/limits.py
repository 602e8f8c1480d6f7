"""Request body size limit, enforced before anything parses the body (ASGI middleware).

A declared ``Content-Length`` over the limit is refused at once; otherwise the body is read here, at
most the limit's worth, and replayed to the app (the app reads it whole anyway to parse the JSON). A
body that crosses the limit is refused without ever being held whole. Either way: 413 with the error
envelope, before the app runs.
"""

from __future__ import annotations

import json


class BodyLimit:
    def __init__(self, app, max_bytes: int, on_reject=lambda: None):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client went away: let the app see it
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send):
        self.on_reject()
        body = json.dumps({"error": {"message": f"request body over the limit of {self.max_bytes} bytes "
                                                "(--max-request-bytes)", "type": "invalid_request_error",
                                     "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
