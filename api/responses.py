"""Response classes: orjson bodies, and an SSE response that notices a client leaving at any time."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import anyio
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
        async with anyio.create_task_group() as group:

            async def run(func: Any) -> None:
                await func()
                group.cancel_scope.cancel()

            async def stream() -> None:
                # A write to a client that already left: the disconnect listener ends the group.
                with contextlib.suppress(OSError):
                    await self.stream_response(send)

            group.start_soon(run, stream)
            await run(partial(self.listen_for_disconnect, receive))
