"""The tiered circuit breakers on a real Redis, driven with synthetic latencies: trip, signal, recovery."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from queues.breakers import read_breakers
from queues.connection import connect
from queues.keys import Keys
from tests.stack import unique_prefix
from workers.breakers import BreakerConfig, Breakers


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_url, timeout_s=1.0)
    yield client
    await client.aclose()


class Events:
    """Stands in for the worker's tc:events writer: what the breakers announced, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, kind: str, **fields: Any) -> None:
        self.seen.append((kind, fields))

    def kinds(self) -> list[str]:
        return [kind for kind, _fields in self.seen]


@contextlib.asynccontextmanager
async def breakers(redis: aioredis.Redis, **config: Any) -> AsyncIterator[tuple[Breakers, Events, Keys]]:
    keys = Keys(unique_prefix())
    events = Events()
    handle = Breakers(redis, keys, BreakerConfig(**config), events=events)
    try:
        yield handle, events, keys
    finally:
        await handle.close()
        found = [key async for key in redis.scan_iter(match=f"{keys.prefix}*")]
        if found:
            await redis.delete(*found)


async def test_three_slow_realtime_requests_in_a_row_open_tier_0_and_good_ones_on_probation_close_it(
    redis: aioredis.Redis,
) -> None:
    async with breakers(redis, realtime_open_s=1.0) as (handle, events, keys):

        async def finish(e2e_ms: int, at_ms: int) -> None:
            await handle.record("realtime", ttft_ms=50, e2e_ms=e2e_ms, request_id="r", now_ms=at_ms)

        for latency in (900, 950, 300, 900, 900):  # a fast one in between: not three in a row
            await finish(latency, 1_000)
        assert (await read_breakers(redis, keys))["realtime"].state == "closed"
        await finish(1_200, 1_000)
        view = (await read_breakers(redis, keys))["realtime"]
        assert view.state == "open" and "3 realtime requests in a row over 800 ms" in view.reason
        await handle.refresh()
        assert handle.degrade_mode and not handle.admits_background
        await finish(200, 1_500)  # still open: its time is not up
        assert (await read_breakers(redis, keys))["realtime"].state == "open"
        await handle.evaluate_now(2_100)  # time up: probation
        assert (await read_breakers(redis, keys))["realtime"].state == "half_open"
        await handle.refresh()
        assert not handle.degrade_mode and handle.admits_background, "probation is normal service"
        await finish(200, 2_200)
        await finish(1_000, 2_300)  # slow on probation: open again
        assert (await read_breakers(redis, keys))["realtime"].state == "open"
        for at_ms in (3_400, 3_500, 3_600):  # time up again, then three good ones
            await finish(200, at_ms)
        await handle.refresh()
    assert handle.views["realtime"].state == "closed" and handle.admits_background
    assert events.kinds() == [
        "breaker_open",
        "breaker_half_open",
        "breaker_open",
        "breaker_half_open",
        "breaker_closed",
    ]


async def test_workers_finishing_slow_requests_at_once_trip_tier_0_exactly_once(redis: aioredis.Redis) -> None:
    async with breakers(redis) as (handle, events, _keys):
        await asyncio.gather(
            *(handle.record("realtime", ttft_ms=1, e2e_ms=2_000, request_id=f"r{n}", now_ms=5) for n in range(20))
        )
    assert events.kinds() == ["breaker_open"]


@contextlib.contextmanager
def webhook(fail_first: int) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A local HTTP endpoint that answers 500 to its first ``fail_first`` calls, then 204."""
    received: list[dict[str, Any]] = []
    calls = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            calls[0] += 1
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if calls[0] <= fail_first:
                self.send_response(500)
            else:
                received.append(orjson.loads(body))
                self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/scale", received
    finally:
        server.shutdown()
        server.server_close()


async def test_a_slow_normal_p99_over_the_window_signals_scale_up_by_event_state_and_webhook_then_clears(
    redis: aioredis.Redis,
) -> None:
    with webhook(fail_first=1) as (url, received):
        async with breakers(redis, min_samples=10, normal_window_s=60, webhook_url=url) as (handle, events, keys):
            for n in range(9):
                await handle.record("normal", ttft_ms=3_000, e2e_ms=9_000, request_id=f"slow{n}", now_ms=1_000)
            await handle.evaluate_now(1_000)
            assert (await read_breakers(redis, keys))["normal"].state == "closed", "too few samples to judge"
            await handle.record("normal", ttft_ms=3_000, e2e_ms=9_000, request_id="slow9", now_ms=1_000)
            await handle.evaluate_now(1_000)
            assert (await read_breakers(redis, keys))["normal"].state == "open"
            # A minute later the slow samples have left the window; fast ones came meanwhile.
            for n in range(10):
                await handle.record("normal", ttft_ms=100, e2e_ms=2_000, request_id=f"fast{n}", now_ms=50_000)
            await handle.evaluate_now(62_000)
            assert (await read_breakers(redis, keys))["normal"].state == "closed"
            for _ in range(100):  # the webhook calls run in the background, the first one retried
                if len(received) == 2:
                    break
                await asyncio.sleep(0.05)
    assert events.kinds() == ["normal_scale_up", "normal_scale_up_cleared"]
    assert events.seen[0][1]["p99_ms"] == 3_000 and events.seen[0][1]["samples"] == 10
    assert [body["event"] for body in received] == ["normal_scale_up", "normal_scale_up_cleared"]


async def test_a_slow_background_tier_is_logged_only(redis: aioredis.Redis) -> None:
    with webhook(fail_first=0) as (url, received):
        async with breakers(redis, min_samples=3, webhook_url=url) as (handle, events, keys):
            for n in range(3):
                await handle.record("background", ttft_ms=120_000, e2e_ms=600_000, request_id=f"b{n}", now_ms=7)
            await handle.evaluate_now(7)
            state = (await read_breakers(redis, keys))["background"].state
            await handle.refresh()
            admits = handle.admits_background
    assert state == "open" and events.kinds() == ["background_slow"]
    assert admits, "a slow background tier changes nothing but the log"
    assert received == [], "no webhook for tier 2"
