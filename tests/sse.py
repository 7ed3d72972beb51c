"""A minimal SSE reader for tests: the ``data:`` payloads of one streamed response, in order."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from api.responses import PING
from bench.sse import sse_lines

DONE = "[DONE]"


async def read_for(response: httpx.Response, seconds: float) -> bytes:
    """What ``response`` sends within ``seconds`` (a stream that is expected to stay open), raw."""
    received: list[bytes] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            async for raw in response.aiter_raw():
                received.append(raw)
    return b"".join(received)


def assert_only_pings(received: bytes) -> None:
    """An open stream that waits: SSE ping comments now and then (at least two), and nothing else."""
    assert received.count(PING) >= 2, received
    assert received.replace(PING, b"") == b"", received


async def frames(response: httpx.Response) -> AsyncIterator[tuple[int | None, Any]]:
    """Each ``data:`` payload of ``response`` (parsed JSON, or ``DONE``) with the SSE ``id:`` before it
    (None when it has none)."""
    event_id: int | None = None
    async for line in sse_lines(response):
        if line.startswith("id: "):
            event_id = int(line.removeprefix("id: "))
        elif line.startswith("data: "):
            payload = line.removeprefix("data: ")
            yield event_id, DONE if payload == DONE else orjson.loads(payload)
            event_id = None


def positions_grow(event_ids: list[int]) -> bool:
    """Whether a stream's SSE ids say each position came once, in order: a frame's id is the last
    position it carries (a stream that fell behind gets several in one frame), so the ids only grow.
    Whether one is missing, the tokens say."""
    return bool(event_ids) and event_ids == sorted(set(event_ids))


async def stream_events(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None
) -> list[Any]:
    events: list[Any] = []
    async with client.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [payload async for _id, payload in frames(response)]
    return events


def streamed_token_ids(events: list[Any]) -> list[int]:
    ids: list[int] = []
    for event in events:
        if isinstance(event, dict) and event.get("choices"):
            ids += event["choices"][0].get("token_ids", [])
    return ids


def finish_reasons(events: list[Any]) -> list[str]:
    return [
        event["choices"][0]["finish_reason"]
        for event in events
        if isinstance(event, dict) and event.get("choices") and event["choices"][0].get("finish_reason")
    ]
