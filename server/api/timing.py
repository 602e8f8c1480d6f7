"""The HTTP edge of the request timeline (``engine.timeline``): an ASGI middleware that opens a timeline
when a generation request arrives (or takes the one the connection opened as its headers arrived,
``api.connections``), makes it current while the app handles the request, and observes it when the first
byte of the answer is sent."""

from __future__ import annotations

import asyncio

from mambaserve.server.engine import timeline

GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
ARRIVAL = "mambaserve.timeline"  # scope key: the timeline the connection opened as the headers arrived


class StageTimer:
    def __init__(self, app, histogram):
        self.app, self.histogram = app, histogram

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        tl = scope.get(ARRIVAL) or timeline.Timeline()
        token = timeline.current.set(tl)

        async def timed_send(message):
            if message["type"] != "http.response.body" or "first_byte" in tl.marks:
                return await send(message)
            tl.mark("first_byte")
            try:
                await send(message)
            finally:
                # after the write, and after the writes already due on the event loop: a burst's first tokens
                # reach their clients one after another, none waiting for the histograms of those before it
                asyncio.get_running_loop().call_soon(timeline.observe, tl, self.histogram)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            timeline.current.reset(token)
