"""Response classes: orjson bodies, and an SSE response that notices a client leaving at any time."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send


class OrjsonResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` that cancels its body iterator as soon as the client disconnects.

    Starlette on ASGI 2.4 servers only notices a gone client when a write fails, which for a request
    still waiting in a queue may be minutes away; we listen for ``http.disconnect`` the whole time so
    the request is cancelled (and aborted in the engine) at once.
    """

    media_type = "text/event-stream"

    def __init__(self, content: Any, headers: dict[str, str] | None = None) -> None:
        base_headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, headers={**base_headers, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # One watcher task beside the response's own, plain asyncio: an anyio task group here (what
        # Starlette uses) costs as much again per request as the rest of this class.
        streaming = asyncio.current_task()
        assert streaming is not None
        left = False

        async def watch() -> None:
            nonlocal left
            with contextlib.suppress(Exception):  # a receive that fails: the client is gone all the same
                await self.listen_for_disconnect(receive)
            left = True
            streaming.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            # A write to a client that already left: the watcher ends the response.
            with contextlib.suppress(OSError):
                await self.stream_response(send)
        except asyncio.CancelledError:
            if not left:
                raise
            streaming.uncancel()  # ours: the client left, and the body iterator was cancelled
        finally:
            watcher.cancel()
