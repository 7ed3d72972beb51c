"""Which requests the fast path takes, and that what it hands on reaches the app unchanged."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import Message, Receive, Scope, Send

from api import fastpath
from api.schemas import ChatCompletionRequest, CompletionRequest
from tailcut.errors import OverloadedError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class Inner:
    """The app behind: records the body it read."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        self.bodies.append(body)
        await PlainTextResponse("app")(scope, receive, send)


def scope_of(path: str, *, method: str = "POST", headers: list[tuple[bytes, bytes]] | None = None) -> Scope:
    state = SimpleNamespace(settings=SimpleNamespace(api_keys=["key"]), key_cache=None)
    return {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(b"authorization", b"Bearer key"), *(headers or [(b"content-type", b"application/json")])],
        "query_string": b"",
        "app": SimpleNamespace(state=SimpleNamespace(tailcut=state)),
    }


async def call(app: Any, scope: Scope, body: bytes, *, parts: int = 1) -> tuple[int, bytes]:
    size = -(-len(body) // parts) or 1
    pieces = [body[start : start + size] for start in range(0, len(body), size)] or [b""]
    messages: list[Message] = [
        {"type": "http.request", "body": piece, "more_body": index < len(pieces) - 1}
        for index, piece in enumerate(pieces)
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(message.get("body", b"") for message in sent[1:])


@pytest.fixture
def endpoints(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []

    async def endpoint(body: Any, request: Request) -> Response:
        seen.append(body)
        if getattr(body, "user", None) == "overloaded":
            raise OverloadedError("too busy", tier="normal", retry_after_s=2)
        return PlainTextResponse("fast")

    monkeypatch.setattr(
        fastpath,
        "ROUTES",
        {"/v1/chat/completions": (ChatCompletionRequest, endpoint), "/v1/completions": (CompletionRequest, endpoint)},
    )
    return seen


async def test_a_valid_body_goes_to_its_endpoint_and_not_through_the_app(endpoints: list[Any]) -> None:
    inner = Inner()
    status, body = await call(fastpath.FastPath(inner), scope_of("/v1/chat/completions"), orjson.dumps(CHAT), parts=3)
    assert (status, body) == (200, b"fast")
    assert inner.bodies == []
    assert isinstance(endpoints[0], ChatCompletionRequest) and endpoints[0].messages[0].text() == "hi"
    status, body = await call(
        fastpath.FastPath(inner),
        scope_of("/v1/completions", headers=[(b"content-type", b"Application/JSON; charset=utf-8")]),
        orjson.dumps({"model": "m", "prompt": "x"}),
    )
    assert (status, body) == (200, b"fast") and isinstance(endpoints[1], CompletionRequest)


@pytest.mark.parametrize(
    ("path", "method", "headers", "body"),
    [
        ("/v1/chat/completions", "POST", None, b'{"model": "m", "messages": []'),  # not JSON
        ("/v1/chat/completions", "POST", None, b'[{"model": "m"}]'),  # not an object
        ("/v1/chat/completions", "POST", None, orjson.dumps({"model": "m", "messages": "hi"})),  # does not validate
        ("/v1/chat/completions", "POST", None, b""),  # no body
        ("/v1/chat/completions", "POST", [(b"content-type", b"text/plain")], orjson.dumps(CHAT)),
        ("/v1/chat/completions", "PUT", None, orjson.dumps(CHAT)),
        ("/v1/models", "POST", None, orjson.dumps(CHAT)),
    ],
)
async def test_anything_else_reaches_the_app_with_its_body_as_it_came(
    endpoints: list[Any], path: str, method: str, headers: list[tuple[bytes, bytes]] | None, body: bytes
) -> None:
    inner = Inner()
    status, answer = await call(fastpath.FastPath(inner), scope_of(path, method=method, headers=headers), body, parts=2)
    assert (status, answer) == (200, b"app")
    assert inner.bodies == [body]
    assert endpoints == []


async def test_errors_are_shaped_as_the_apps_handlers_shape_them(endpoints: list[Any]) -> None:
    inner = Inner()
    scope = scope_of("/v1/chat/completions")
    status, body = await call(fastpath.FastPath(inner), scope, orjson.dumps({**CHAT, "user": "overloaded"}))
    assert status == 429
    assert orjson.loads(body)["error"]["type"] == "rate_limit_error"
    scope["headers"] = [(b"authorization", b"Bearer wrong"), (b"content-type", b"application/json")]
    status, body = await call(fastpath.FastPath(inner), scope, orjson.dumps(CHAT))
    assert status == 401 and orjson.loads(body)["error"]["type"] == "authentication_error"
    assert len(endpoints) == 1 and inner.bodies == []  # the key is checked before the endpoint runs
