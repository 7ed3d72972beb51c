"""The SSE response's writes: the frame with ``[DONE]`` ends the body in the same ASGI message."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.types import Message

from api.responses import DONE, EventStreamResponse


async def respond(frames: list[bytes], closed: list[bool]) -> list[Message]:
    async def body() -> AsyncIterator[bytes]:
        try:
            for frame in frames:
                yield frame
        finally:
            closed.append(True)

    sent: list[Message] = []

    async def receive() -> Message:
        await asyncio.Event().wait()  # the client stays
        raise AssertionError

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "GET", "path": "/"}
    await EventStreamResponse(body())(scope, receive, send)
    return sent


async def test_the_last_frame_ends_the_body_in_the_same_message() -> None:
    closed: list[bool] = []
    sent = await respond([b"data: {}\n\n", b"data: {}\n\n" + DONE], closed)
    assert [message["type"] for message in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert [(message["body"], message["more_body"]) for message in sent[1:]] == [
        (b"data: {}\n\n", True),
        (b"data: {}\n\n" + DONE, False),
    ]
    assert closed == [True]


async def test_a_stream_without_done_ends_with_an_empty_message() -> None:
    closed: list[bool] = []
    sent = await respond([b"data: {}\n\n"], closed)
    assert [(message["body"], message["more_body"]) for message in sent[1:]] == [(b"data: {}\n\n", True), (b"", False)]
    assert closed == [True]
