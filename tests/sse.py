"""A minimal SSE reader for tests: the ``data:`` payloads of one streamed response, in order."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

DONE = "[DONE]"


async def stream_events(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None
) -> list[Any]:
    events: list[Any] = []
    async with client.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(DONE if payload == DONE else orjson.loads(payload))
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
