"""The generation routes without the framework's per-request layers: a well-formed JSON body for
``POST /v1/chat/completions`` or ``/v1/completions`` goes from here straight to its endpoint.

FastAPI spends on every request what these two routes do not need: the exception and exit-stack
middleware, matching the path against every route, solving the router's dependencies, reading the body
through ``Request`` and validating it through a ``TypeAdapter`` of the annotated parameter, and one more
wrapper around each ``send``. At the benchmark's rates that is a fifth of the API's CPU (BENCHMARKS.md,
cost per token). This middleware does the same work in a few lines: the body is parsed (orjson) and
validated by the route's own model, the key is checked (``check_auth``, the router's one dependency), and
the endpoint's response is sent as the ASGI app it is.

Only the plain case is taken; everything else goes on to FastAPI with the body handed over as it came,
so every error keeps the one shape the app gives it: a body that is not JSON, not an object or does not
validate, a content type other than JSON, any other method or path. An error the endpoint raises is
rendered as the app's exception handlers render it (``api.errors``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import check_auth
from api.errors import error_response, unexpected_response
from api.openai_routes import chat_completions, completions
from api.schemas import ChatCompletionRequest, CompletionRequest
from tailcut.errors import TailcutError

Endpoint = Callable[[Any, Request], Awaitable[Response]]

# Path → (the body's model, the endpoint): the routes of ``api.openai_routes`` taken here.
ROUTES: dict[str, tuple[type[BaseModel], Endpoint]] = {
    "/v1/chat/completions": (ChatCompletionRequest, chat_completions),
    "/v1/completions": (CompletionRequest, completions),
}


def is_json(scope: Scope) -> bool:
    """Whether the request says its body is JSON, or says nothing (FastAPI reads both as JSON)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bool(value.partition(b";")[0].strip().lower() == b"application/json")
    return True


class FastPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or not is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before its body arrived: nothing was accepted
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        model, endpoint = route
        try:
            fields = orjson.loads(body)
            parsed = model.model_validate(fields) if isinstance(fields, dict) else None
        except (orjson.JSONDecodeError, ValidationError):
            parsed = None
        if parsed is None:
            await self.app(scope, handing_over(body, receive), send)
            return
        request = Request(scope, receive)
        try:
            await check_auth(request)
            response = await endpoint(parsed, request)
        except TailcutError as exc:
            response = error_response(exc)
        except Exception as exc:  # what the app's handler of last resort answers, the same way
            response = unexpected_response(exc)
        await response(scope, receive, send)


def handing_over(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read given back first, for the app behind."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
