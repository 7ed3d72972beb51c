"""A request body larger than ``max_bytes`` is refused with a 413 (OpenAI-shaped) before it is parsed:
by its Content-Length when it sends one, else as soon as what arrived passes the bound."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.max_bytes:
            await self.app(scope, receive, send)
            return
        length = content_length(scope)
        if length is not None and length.isdigit():
            if int(length) > self.max_bytes:
                await self._refuse(send)
                return
            # The server reads no more than the Content-Length it was told: nothing to count, and the
            # response's every write goes straight through.
            await self.app(scope, receive, send)
            return
        seen = 0
        refused = False

        async def counting_receive() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Answer now; to the app the client is gone, and whatever it sends is dropped.
                    refused = True
                    await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, send: Send) -> None:
        body: dict[str, Any] = {
            "error": {
                "message": f"the request body is larger than {self.max_bytes} bytes (TAILCUT_MAX_BODY_BYTES)",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_too_large",
            }
        }
        payload = orjson.dumps(body)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def content_length(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            return bytes(value)
    return None
