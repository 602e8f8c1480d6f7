"""Every POST body is JSON, whatever its ``Content-Type`` says (ASGI middleware).

``curl -d '{...}'`` sends ``application/x-www-form-urlencoded``, and many clients send no type at all;
FastAPI would answer those with a 422 that names no cause. The header is rewritten to JSON, so such a
body is parsed as JSON (a body that is not JSON gets the 400 ``invalid_json`` error).
"""

from __future__ import annotations

JSON = b"application/json"


class JsonBody:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            declared = dict(scope.get("headers") or []).get(b"content-type", b"")
            if not declared.split(b";")[0].strip().endswith(b"json"):
                scope = {**scope, "headers": headers + [(b"content-type", JSON)]}
        await self.app(scope, receive, send)
