"""Resumable requests on the real engine: SSE ids, ``GET /v1/requests/{id}`` after ``Last-Event-ID``,
tenant ownership, and ``Idempotency-Key`` answered by the one execution it names."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from queues.output import read_output
from tests.sse import DONE, assert_only_pings, frames, positions_grow, read_for, stream_events, streamed_token_ids
from tests.stack import running_stack
from workers.engines.vllm_engine import VllmEngine

pytestmark = pytest.mark.engine

BODY = {
    "model": "tiny",
    "prompt": list(range(100, 130)),
    "max_tokens": 300,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "return_token_ids": True,
}


async def read_some(
    client: httpx.AsyncClient, url: str, num_tokens: int, **kwargs: Any
) -> tuple[httpx.Headers, list[tuple[int | None, Any]]]:
    """The frames of a stream as (SSE id, payload) until they carried ``num_tokens`` tokens; then the
    connection is dropped. Counted in tokens, not frames: a client that fell behind gets several
    positions in one frame, under the last one's id."""
    events: list[tuple[int | None, Any]] = []
    async with client.stream("POST", url, **kwargs) as response:
        assert response.status_code == 200, await response.aread()
        async for frame in frames(response):
            events.append(frame)
            if len(streamed_token_ids([payload for _id, payload in events])) >= num_tokens:
                break
        return response.headers, events


async def resume(client: httpx.AsyncClient, request_id: str, **headers: str) -> list[Any]:
    async with client.stream("GET", f"/v1/requests/{request_id}", headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        return [payload async for _id, payload in frames(response)]


async def test_a_dropped_stream_resumes_after_its_last_event_id_with_nothing_lost_or_repeated(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    async with running_stack(redis_url, tiny_model, engine) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            reference = streamed_token_ids(await stream_events(client, "/v1/completions", BODY))
            headers, first = await read_some(
                client, "/v1/completions", 25, json=BODY, headers={"Idempotency-Key": "resume-1"}
            )
            request_id = headers["x-tailcut-request-id"]
            ids = [event_id for event_id, _payload in first]
            # Each frame read is a content chunk under the last position it holds (the stream went on).
            assert all(isinstance(payload, dict) and payload.get("choices") for _id, payload in first), first
            assert all(event_id is not None for event_id in ids) and positions_grow(ids) and ids[0] >= 1, first
            rest = await resume(client, request_id, **{"Last-Event-ID": str(ids[-1])})
            again = await resume(client, request_id)  # no Last-Event-ID: from the start
            served = Counter(stack.workers[0].served_ids)
    assert streamed_token_ids([payload for _id, payload in first]) + streamed_token_ids(rest) == reference
    assert rest[-1] == DONE
    assert streamed_token_ids(again) == reference
    assert served[request_id] == 1, "the resumes read the one execution"


async def test_only_the_owning_tenant_reads_a_request_and_an_unknown_id_is_404(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    body = {**BODY, "max_tokens": 5, "stream": False}
    async with running_stack(redis_url, tiny_model, engine) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            done = await client.post("/v1/completions", json=body, headers={"X-Tailcut-Tenant": "acme"})
            request_id = done.headers["x-tailcut-request-id"]
            mine = await client.get(f"/v1/requests/{request_id}?stream=false", headers={"X-Tailcut-Tenant": "acme"})
            theirs = await client.get(f"/v1/requests/{request_id}", headers={"X-Tailcut-Tenant": "globex"})
            unknown = await client.get("/v1/requests/0123456789abcdef", headers={"X-Tailcut-Tenant": "acme"})
            bad = await client.get(
                f"/v1/requests/{request_id}", headers={"X-Tailcut-Tenant": "acme", "Last-Event-ID": "x"}
            )
    assert mine.status_code == 200 and mine.json()["choices"][0]["text"] == done.json()["choices"][0]["text"]
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json()["error"]["code"] == "request_not_found"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"


async def test_one_idempotency_key_runs_once_however_often_and_concurrently_it_is_sent(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    body = {**BODY, "max_tokens": 120, "stream": False}
    headers = {"Idempotency-Key": "order-42", "X-Tailcut-Tenant": "acme"}
    async with running_stack(redis_url, tiny_model, engine) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json=body, headers=headers) for _ in range(4))
            )
            streamed = await stream_events(client, "/v1/completions", {**body, "stream": True}, headers=headers)
            other = await client.post("/v1/completions", json={**body, "max_tokens": 7}, headers=headers)
            other_tenant = await client.post(
                "/v1/completions", json=body, headers={**headers, "X-Tailcut-Tenant": "globex"}
            )
            # A response leaves as soon as its final event is in Redis; the XACK follows right after.
            deadline = time.monotonic() + 5
            while len(stack.workers[0].served_ids) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            served = Counter(stack.workers[0].served_ids)
    ids = {answer.headers["x-tailcut-request-id"] for answer in answers}
    assert [answer.status_code for answer in answers] == [200] * 4
    assert len(ids) == 1, "every repeat names the same request"
    (request_id,) = ids
    assert len({answer.json()["choices"][0]["text"] for answer in answers}) == 1
    assert sorted(answer.headers.get("idempotent-replayed", "") for answer in answers) == ["", "true", "true", "true"]
    assert streamed_token_ids(streamed) == answers[0].json()["choices"][0]["token_ids"]
    assert other.status_code == 400
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert other_tenant.status_code == 200 and other_tenant.headers["x-tailcut-request-id"] != request_id
    assert served[request_id] == 1, "one execution for the one key"
    assert sum(served.values()) == 2, "the other tenant's key is its own"


async def test_a_resumable_request_whose_client_never_comes_back_is_cancelled_after_the_grace(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    body = {**BODY, "max_tokens": 1900}
    async with running_stack(redis_url, tiny_model, engine, resume_grace_s=0.5) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            headers, _first = await read_some(
                client, "/v1/completions", 5, json=body, headers={"Idempotency-Key": "gone"}
            )
            left_at = time.monotonic()
            request_id = headers["x-tailcut-request-id"]
            while stack.workers[0].running_ids:
                assert time.monotonic() - left_at < 3.0, "the request was not cancelled after the grace"
                await asyncio.sleep(0.02)
            stopped_after_s = time.monotonic() - left_at
            events = await read_output(stack.redis, stack.keys, request_id, from_seq=1)
    assert stopped_after_s >= 0.5, "cancelled before the grace was over"
    assert [(event.type, event.error_code) for event in events if event.terminal] == [("error", "cancelled")]


async def test_a_resume_of_a_request_still_in_its_queue_gets_pings_and_nothing_else(
    redis_url: str, tiny_model: Path
) -> None:
    """A resume reads the durable output (``follow_output``), not the live replies: it keeps a silent
    connection alive the same way (``TAILCUT_SSE_PING_S``), here with no worker to run the request."""
    body = {**BODY, "max_tokens": 5}
    async with running_stack(redis_url, tiny_model, None, sse_ping_s=0.4) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            headers = {"Idempotency-Key": "still-queued"}
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
                assert response.status_code == 200
                request_id = response.headers["x-tailcut-request-id"]
            async with client.stream("GET", f"/v1/requests/{request_id}") as response:
                assert response.status_code == 200
                waited = await read_for(response, 5.0)
    assert_only_pings(waited)
