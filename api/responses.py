"""Response classes: orjson bodies, and an SSE response that notices a client leaving at any time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

# The last frame of an OpenAI stream.
DONE = b"data: [DONE]\n\n"
# An SSE comment: keeps a waiting stream's connection busy; clients skip it (OpenAI's and vLLM's do).
PING = b": ping\n\n"


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
    body_iterator: AsyncIterator[bytes]

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

    async def stream_response(self, send: Send) -> None:
        """Starlette's, except that the frame ending in ``[DONE]`` also ends the body: the server writes it
        and the chunked encoding's terminator together, one socket write per reply fewer."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        frames = self.body_iterator
        try:
            async for frame in frames:
                last = frame.endswith(DONE)
                await send({"type": "http.response.body", "body": frame, "more_body": not last})
                if last:
                    return
        finally:
            close = getattr(frames, "aclose", None)
            if close is not None:  # left before its end: its own clean-up runs now, not when collected
                await close()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
