"""Redis failure modes on a real, private Redis (no engine): a restart without persistence loses what
was accepted, and a reply-channel subscriber that Redis cuts off for falling behind
(``client-output-buffer-limit pubsub``) still gets every position, from the durable output stream.

The other side of persistence, and a restart that lost everything while workers run, need the engine:
``tests/e2e/test_redis_faults.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from bench.sse import sse_lines
from queues import intake
from queues.connection import connect, connect_blocking
from queues.keys import Keys
from queues.messages import OutputEvent, RequestMessage, SamplingSpec
from queues.output import OutputWriter
from queues.replies import ReplyRouter
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.sse import frames as sse_frames
from tests.stack import private_redis_server, running_stack, running_workers, unique_prefix
from workers.engines.factory import start_engine
from workers.settings import EngineSettings, WorkerSettings

NO_PERSISTENCE = ("--appendonly", "no", "--save", "")
# Redis drops a pub/sub client once 32 KiB wait unsent for it; the kernel's socket buffers hold some
# megabytes before that, so the "worker" below writes until Redis reports the client gone.
PUBSUB_LIMIT = ("--client-output-buffer-limit", "pubsub", "32kb", "0", "0")
CUT_OFF_LOG = "for overcoming of output buffer limits"
# Each chunk's text: a few KiB, so one PUBLISH stays well under the limit (the client is cut off for
# falling behind, not for one oversized message).
CHUNK_TEXT = "x" * 4000
MAX_CHUNKS = 20_000  # 80 MB: far past any loopback socket buffer
CHUNKS_AFTER_CUT_OFF = 50
API_ID = "api-faults"


async def wait_for(condition: Callable[[], Awaitable[bool]], *, timeout_s: float, what: str) -> None:
    """Poll ``condition`` until true; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.05)


async def queued(redis: aioredis.Redis, keys: Keys) -> int:
    """Entries in the stack's intake streams."""
    return sum([await redis.xlen(stream) for stream in keys.intake_all()])


async def accept(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    """POST a streamed request and return its id once accepted (the response starts only after the
    XADD returned); the stream is then closed."""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        return response.headers["x-tailcut-request-id"]


async def api_reconnected(client: httpx.AsyncClient) -> bool:
    """/readyz finds Redis and the reply channel again (no worker runs in these tests)."""
    problems = (await client.get("/readyz")).json()["problems"]
    return bool(problems == ["no live worker"])


async def test_without_persistence_a_redis_restart_loses_every_accepted_request(
    tiny_model: Path, free_port: int, tmp_path: Path
) -> None:
    """The documented other side of "nothing accepted is lost": Redis without AOF (or RDB) keeps
    accepted requests only in memory, and a SIGKILL and restart on the same folder and port loses
    every one of them: their intake entries and their records are gone, and a resume says 404. A
    client still waiting on one is told so (``request_lost``) instead of waiting for ever.
    (With ``appendonly yes`` the same steps lose nothing: ``tests/e2e/test_redis_faults.py``.)"""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "stream": True}
    with contextlib.ExitStack() as servers:
        first = servers.enter_context(private_redis_server(free_port, "--dir", str(tmp_path), *NO_PERSISTENCE))
        async with running_stack(first.url, tiny_model, None) as stack:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
                ids = [await accept(client, body) for _ in range(3)]
                waiting = asyncio.create_task(read_to_end(client, body))

                async def all_queued() -> bool:
                    return await queued(stack.redis, stack.keys) == 4

                await wait_for(all_queued, timeout_s=5, what="the waiting client's request was accepted")
                first.kill()  # SIGKILL
                second = servers.enter_context(private_redis_server(free_port, "--dir", str(tmp_path), *NO_PERSISTENCE))
                fresh = connect(second.url, timeout_s=1.0)
                try:
                    assert await queued(fresh, stack.keys) == 0, "entries survived a restart without persistence"
                    assert not await fresh.exists(*[stack.keys.request(request_id) for request_id in ids])
                finally:
                    await fresh.aclose()
                await wait_for(lambda: api_reconnected(client), timeout_s=10, what="the API reconnected to Redis")
                for request_id in ids:
                    resumed = await client.get(f"/v1/requests/{request_id}")
                    assert resumed.status_code == 404, resumed.text
                async with asyncio.timeout(20):
                    frames = await waiting
    errors = [frame["error"] for frame in frames if isinstance(frame, dict) and "error" in frame]
    assert [error["code"] for error in errors] == ["request_lost"], frames
    assert frames[-1] == "[DONE]"


async def read_to_end(client: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    """The data frames of a streamed request, read to its end."""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        return [payload async for _id, payload in sse_frames(response)]


# --- a pub/sub subscriber cut off for falling behind -------------------------------------------


def write_while_blocked(url: str, keys: Keys, request_id: str, reply_to: str) -> tuple[int, int | None]:
    """A worker's output, written by a real ``OutputWriter`` (one flush per chunk: one PUBLISH each)
    from another thread with its own event loop, while the caller's loop stays blocked in this call
    and so never reads its subscription. Writes until Redis has dropped the subscriber of
    ``reply_to``'s channel, a few more chunks, then the final event. Returns (positions written, the
    position after which the subscriber was found gone, or None)."""

    async def write() -> tuple[int, int | None]:
        redis = connect(url, timeout_s=5.0)
        writer = OutputWriter(redis, keys, ttl_s=600)
        writer.start()
        channel = keys.reply_channel(reply_to)
        cut_off_at: int | None = None
        seq = 0
        try:
            while seq < MAX_CHUNKS and (cut_off_at is None or seq < cut_off_at + CHUNKS_AFTER_CUT_OFF):
                seq += 1
                writer.emit(
                    reply_to, OutputEvent(rid=request_id, seq=seq, type="chunk", text=CHUNK_TEXT, token_ids=[seq])
                )
                await writer.flush()
                if cut_off_at is None and seq % 8 == 0:
                    ((_name, subscribers),) = await redis.pubsub_numsub(channel)
                    cut_off_at = seq if subscribers == 0 else None
            seq += 1
            final = OutputEvent(
                rid=request_id,
                seq=seq,
                type="final",
                finish_reason="length",
                prompt_tokens=3,
                completion_tokens=seq - 1,
            )
            writer.emit(reply_to, final)
            await writer.close()
        finally:
            await redis.aclose()
        return seq, cut_off_at

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, write()).result(timeout=60)


async def subscribed(redis: aioredis.Redis, channel: str) -> bool:
    with contextlib.suppress(RedisError):
        ((_name, subscribers),) = await redis.pubsub_numsub(channel)
        return bool(subscribers == 1)
    return False


async def test_a_router_cut_off_by_the_pubsub_buffer_limit_yields_every_position_once_from_the_stream(
    free_port: int, tmp_path: Path
) -> None:
    """The API's reply router stops reading (its event loop is blocked) while a worker publishes far
    more than Redis buffers for a subscriber: Redis closes the connection. Once the loop runs again
    the request's stream still yields every position 1..N exactly once, in order, ending with the
    final event (the missing ones from ``tc:out:{id}``), and the router subscribes again."""
    log_file = tmp_path / "redis.log"
    with private_redis_server(free_port, *PUBSUB_LIMIT, "--logfile", str(log_file)) as server:
        keys = Keys(unique_prefix())
        redis = connect(server.url, timeout_s=1.0)
        pubsub = connect_blocking(server.url, block_s=1.0, connect_timeout_s=1.0)
        router = ReplyRouter(redis, pubsub, keys, API_ID, poll_max_s=0.5)
        await router.start(wait_s=5)
        try:
            request_id = uuid.uuid4().hex
            stream = router.open(request_id)

            async def read_all() -> list[OutputEvent]:
                return [event async for event in stream.events()]

            reader = asyncio.create_task(read_all())
            num_positions, cut_off_at = write_while_blocked(server.url, keys, request_id, API_ID)
            assert cut_off_at is not None, f"Redis never dropped the subscriber in {num_positions} positions"
            assert CUT_OFF_LOG in log_file.read_text(), "Redis did not say why it closed the subscriber"
            try:
                async with asyncio.timeout(20):
                    events = await reader
            except TimeoutError:
                raise AssertionError(f"the stream did not end within 20 s ({stream.next_seq - 1} positions)") from None
            stream.close()
            await wait_for(lambda: subscribed(redis, router.channel), timeout_s=10, what="the router subscribed again")
        finally:
            await router.stop()
            await pubsub.aclose()
            await redis.aclose()
    print(f"\nsubscriber cut off after {cut_off_at} of {num_positions} positions")
    assert [event.seq for event in events] == list(range(1, num_positions + 1))
    assert [event.type for event in events] == ["chunk"] * (num_positions - 1) + ["final"]
    assert all(event.token_ids == [event.seq] for event in events[:-1])


async def read_sse(response: httpx.Response) -> list[tuple[int | None, Any]]:
    """(SSE id or None, data payload) of every frame, until the stream ends."""
    frames: list[tuple[int | None, Any]] = []
    event_id: int | None = None
    async for line in sse_lines(response):
        if line.startswith("id: "):
            event_id = int(line.removeprefix("id: "))
        elif line.startswith("data: "):
            payload = line.removeprefix("data: ")
            frames.append((event_id, payload if payload == "[DONE]" else orjson.loads(payload)))
            event_id = None
    return frames


async def test_a_streaming_client_through_the_api_gets_its_whole_reply_after_the_api_was_cut_off(
    tiny_model: Path, free_port: int
) -> None:
    """The same through HTTP: an SSE client of the API (on a Redis with the tiny pub/sub limit) whose
    API process falls behind — its event loop blocked, neither its subscription nor the client's
    socket read — while the request's output is published: the client receives every position once,
    in order (every token once; SSE ids that grow up to N), one finish reason, and ``[DONE]``."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "stream": True, "return_token_ids": True}
    with private_redis_server(free_port, *PUBSUB_LIMIT) as server:
        async with running_stack(server.url, tiny_model, None) as stack:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
                async with client.stream(
                    "POST", "/v1/completions", json=body, headers={"X-Tailcut-Event-Ids": "true"}
                ) as response:
                    assert response.status_code == 200
                    request_id = response.headers["x-tailcut-request-id"]
                    reader = asyncio.create_task(read_sse(response))
                    # No worker runs: this thread stands in for the one that would own the request.
                    num_positions, cut_off_at = write_while_blocked(
                        server.url, stack.keys, request_id, stack.api_settings.api_id
                    )
                    assert cut_off_at is not None, f"Redis never dropped the API's subscriber in {num_positions}"
                    try:
                        async with asyncio.timeout(20):
                            frames = await reader
                    except TimeoutError:
                        raise AssertionError("the SSE stream did not end within 20 s") from None
                await wait_for(lambda: api_reconnected(client), timeout_s=10, what="the API subscribed again")
    tokens = [
        token for _id, data in frames if isinstance(data, dict) for token in data["choices"][0].get("token_ids", [])
    ]
    # A stream that fell behind gets a run of positions in one frame, whose id is the run's last position:
    # the ids only grow, and the final event's is the last position.
    ids = [event_id for event_id, _data in frames if event_id is not None]
    assert ids == sorted(set(ids)) and ids[-1] == num_positions and len(ids) == len(frames) - 1
    assert tokens == list(range(1, num_positions))
    assert [data["choices"][0]["finish_reason"] for _id, data in frames[:-1]] == [None] * (len(frames) - 2) + ["length"]
    assert frames[-1] == (None, "[DONE]")


async def test_a_worker_told_to_stop_while_redis_is_gone_stops_within_its_bounds(
    free_port: int, tiny_model: Path
) -> None:
    """A worker (null engine, one request at a time) runs a long reply while a second waits in its
    queue; Redis is SIGKILLed, so the running reply's output piles up unwritten. Told to stop, the
    worker cannot hand the waiting request back (that would wait for the pile to be written) nor
    drain: once one wait for Redis has run out, each later one waits a second, and it stops, leaving
    both pending in Redis for a take-over."""
    engine = start_engine(EngineSettings(kind="null", null_step_ms=20), tiny_model, TEST_MAX_MODEL_LEN)
    keys = Keys(unique_prefix())
    deadline_ms = int(time.time() * 1000) + 600_000
    messages = [
        RequestMessage(
            id=f"long-{index}",
            tenant="t",
            tier="normal",
            bucket="short",
            prompt_token_ids=[1, 2, 3],
            sampling=SamplingSpec(max_tokens=5000),
            predicted_output_tokens=5000,
            enqueued_at_ms=0,
            deadline_ms=deadline_ms,
            reply_to="api-gone",
        )
        for index in range(2)
    ]
    settings = WorkerSettings(
        redis_url=f"redis://127.0.0.1:{free_port}/0", key_prefix=keys.prefix, model=str(tiny_model),
        worker_id="stopping", read_block_ms=100, drain_timeout_s=1, max_running=1, redis_timeout_s=0.5,
    )  # fmt: skip
    try:
        with private_redis_server(free_port, *NO_PERSISTENCE) as server:
            redis = connect(server.url, timeout_s=1.0)
            await intake.ensure_groups(redis, keys)
            for message in messages:
                await intake.enqueue(redis, keys, message)
            workers = running_workers([settings], engine, server.url)
            (worker,) = await workers.__aenter__()
            try:
                async with asyncio.timeout(20):
                    while not (worker.scheduler.num_waiting == 1 and len(worker.served_ids) == 0 and worker._tasks):
                        await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)  # output is flowing
                server.kill()
                await asyncio.sleep(0.5)  # and now piles up
            finally:
                started = time.monotonic()
                async with asyncio.timeout(60):
                    await workers.__aexit__(None, None, None)
                stopped_after_s = time.monotonic() - started
            await redis.aclose()
    finally:
        await engine.shutdown()
    # The waiting request's hand-back runs out (5 s), then the drain (its 1 s); Redis does not answer, so
    # each later wait for it lasts 1 s: the running one's hand-back (then up to 4 cancellations of 1 s),
    # the writer's last write and its close. At most 14 s; with each wait its full bound it took 17 s.
    print(f"\nstopped after {stopped_after_s:.1f} s")
    assert stopped_after_s < 14, f"the worker took {stopped_after_s:.1f} s to stop"
