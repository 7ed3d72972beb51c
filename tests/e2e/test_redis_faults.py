"""Redis restarts with the real engine: the pipeline carries on after a restart that lost everything,
and with ``appendonly yes`` + ``appendfsync always`` every accepted request survives a SIGKILL of
Redis and completes. The cheap sides (no engine) are in ``tests/integration/test_redis_faults.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from admission.tokenizer import PromptTokenizer
from bench.sse import sse_lines
from queues.connection import connect
from queues.keys import WORKER_GROUP, Keys
from queues.output import read_output
from tests.e2e.test_streaming import reference_ids
from tests.sse import DONE, finish_reasons, stream_events, streamed_token_ids
from tests.stack import private_redis_server, running_stack, running_workers
from workers.engines.vllm_engine import VllmEngine
from workers.settings import WorkerSettings

pytestmark = pytest.mark.engine

CHAT = "/v1/chat/completions"
AOF_ALWAYS = ("--appendonly", "yes", "--appendfsync", "always")
MAX_TOKENS = 16


def chat_body(content: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


async def greedy_reference(engine: VllmEngine, tiny_model: Path, content: str, request_id: str) -> list[int]:
    tokenizer = PromptTokenizer(tiny_model, num_threads=1)
    try:
        prompt_ids = await tokenizer.encode_chat([{"role": "user", "content": content}])
    finally:
        tokenizer.close()
    return await reference_ids(engine, prompt_ids, MAX_TOKENS, request_id)


async def wait_for(condition: Callable[[], Awaitable[bool]], *, timeout_s: float, what: str) -> None:
    """Poll ``condition`` until true (a Redis error counts as false); fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(RedisError):
            if await condition():
                return
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.05)


async def queued(redis: aioredis.Redis, keys: Keys) -> int:
    return sum([await redis.xlen(stream) for stream in keys.intake_all()])


async def test_the_api_and_workers_carry_on_after_a_redis_restart_that_lost_everything(
    tiny_model: Path, engine: VllmEngine, free_port: int
) -> None:
    """Redis without persistence is SIGKILLed and started again on the same port, empty: no streams,
    no consumer group, no scripts, no subscriptions. Without restarting anything of tailcut, /readyz
    comes back, the API's reply channel and the worker's cancel channel are subscribed again, the
    worker recreates its group (NOGROUP), a greedy chat completion streams the reference output, and
    a client that leaves still cancels its running request in the engine."""
    content = "what happens when redis restarts?"
    expected = await greedy_reference(engine, tiny_model, content, "reference-redis-restart")
    with contextlib.ExitStack() as servers:
        first = servers.enter_context(private_redis_server(free_port))
        async with running_stack(first.url, tiny_model, engine) as stack:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:

                async def ready() -> bool:
                    return (await client.get("/readyz")).status_code == 200

                await wait_for(ready, timeout_s=10, what="/readyz before the restart")
                before = await stream_events(client, CHAT, chat_body(content))
                assert streamed_token_ids(before) == expected

                async def acknowledged() -> bool:
                    return await queued(stack.redis, stack.keys) == 0

                # The client has its [DONE] a moment before the worker's XACK: kill after it.
                await wait_for(acknowledged, timeout_s=10, what="the first request acknowledged")
                first.kill()  # SIGKILL: nothing is saved, nothing is loaded
                second = servers.enter_context(private_redis_server(free_port))
                fresh = connect(second.url, timeout_s=1.0)
                try:
                    await wait_for(ready, timeout_s=15, what="/readyz after the restart")
                    reply_channel = stack.keys.reply_channel(stack.api_settings.api_id)

                    async def resubscribed() -> bool:
                        counts = dict(await fresh.pubsub_numsub(reply_channel, stack.keys.cancel_channel))
                        return counts == {reply_channel.encode(): 1, stack.keys.cancel_channel.encode(): 1}

                    await wait_for(resubscribed, timeout_s=10, what="the reply and cancel channels subscribed again")
                    try:
                        async with asyncio.timeout(30):
                            after = await stream_events(client, CHAT, chat_body(content))
                    except TimeoutError:
                        raise AssertionError("no reply within 30 s after the restart (did the worker read?)") from None
                    assert streamed_token_ids(after) == expected
                    assert finish_reasons(after) == ["length"] and after[-1] == DONE
                    groups = await fresh.xinfo_groups(stack.keys.intake("realtime", "short"))
                    assert [group["name"] for group in groups] == [WORKER_GROUP.encode()]
                    assert (await client.get("/readyz")).json()["breakers"]["realtime"]["state"] == "closed"

                    # A client that leaves cancels its request: the worker hears it on the new Redis.
                    request_id = await leave_after_the_first_chunk(client)
                    events = await terminal_events(fresh, stack.keys, request_id, timeout_s=30)
                    assert (events[-1].type, events[-1].error_code) == ("error", "cancelled"), events[-1]
                finally:
                    await fresh.aclose()


async def leave_after_the_first_chunk(client: httpx.AsyncClient) -> str:
    """Start a long streamed completion, read its first token, and disconnect; returns its id."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in sse_lines(response):
            if line.startswith("data: "):
                break
        return response.headers["x-tailcut-request-id"]


async def terminal_events(redis: aioredis.Redis, keys: Keys, request_id: str, *, timeout_s: float) -> list[Any]:
    """The request's durable output once it holds a terminal event."""
    found: list[Any] = []

    async def terminal() -> bool:
        found[:] = await read_output(redis, keys, request_id, from_seq=1)
        return bool(found) and found[-1].terminal

    await wait_for(terminal, timeout_s=timeout_s, what=f"a terminal event for {request_id}")
    return found


async def hold_stream(client: httpx.AsyncClient, body: dict[str, Any], accepted: asyncio.Queue[str]) -> list[Any]:
    """One streamed request, read to its end; its id goes to ``accepted`` once it is accepted (the
    response starts only after its XADD returned)."""
    events: list[Any] = []
    async with client.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200, await response.aread()
        accepted.put_nowait(response.headers["x-tailcut-request-id"])
        async for line in sse_lines(response):
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(DONE if payload == DONE else orjson.loads(payload))
    return events


async def test_with_aof_always_every_accepted_request_survives_a_redis_sigkill_and_completes(
    tiny_model: Path, engine: VllmEngine, free_port: int, tmp_path: Path
) -> None:
    """Redis with ``appendonly yes`` and ``appendfsync always`` in a folder of the test's own. Three
    requests are accepted while no worker runs, their clients keep reading; Redis is SIGKILLed and
    started again on the same folder and port: every intake entry and request record is still there.
    A worker started only now serves them: each client's open stream gets its greedy reference, and
    a resume (``GET /v1/requests/{id}``) replays the same reply from the durable output.
    (Without AOF the same steps lose everything: ``tests/integration/test_redis_faults.py``.)"""
    contents = [f"persistence question {index}" for index in range(3)]
    expected = [
        await greedy_reference(engine, tiny_model, content, f"reference-aof-{index}")
        for index, content in enumerate(contents)
    ]
    persistence = ("--dir", str(tmp_path), *AOF_ALWAYS)
    with contextlib.ExitStack() as servers:
        first = servers.enter_context(private_redis_server(free_port, *persistence))
        async with running_stack(first.url, tiny_model, None) as stack:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
                accepted: asyncio.Queue[str] = asyncio.Queue()
                ids: list[str] = []
                streams: list[asyncio.Task[list[Any]]] = []
                for content in contents:  # one at a time, so ids[i] is the id of contents[i]
                    streams.append(asyncio.create_task(hold_stream(client, chat_body(content), accepted)))
                    async with asyncio.timeout(10):
                        ids.append(await accepted.get())
                assert await queued(stack.redis, stack.keys) == 3

                first.kill()  # SIGKILL
                second = servers.enter_context(private_redis_server(free_port, *persistence))
                fresh = connect(second.url, timeout_s=1.0)
                try:
                    assert await queued(fresh, stack.keys) == 3, "accepted requests were lost with AOF on"
                    assert await fresh.exists(*[stack.keys.request(request_id) for request_id in ids]) == 3
                finally:
                    await fresh.aclose()

                worker = WorkerSettings(
                    redis_url=second.url,
                    key_prefix=stack.keys.prefix,
                    model=str(tiny_model),
                    worker_id="after-restart",
                    read_block_ms=200,
                )
                async with running_workers([worker], engine, second.url):
                    try:
                        async with asyncio.timeout(60):
                            replies = await asyncio.gather(*streams)
                    except TimeoutError:
                        raise AssertionError("the accepted requests did not complete within 60 s") from None
                resumed = await client.get(f"/v1/requests/{ids[0]}", params={"stream": "false"})
    for reply, reference in zip(replies, expected, strict=True):
        assert streamed_token_ids(reply) == reference
        assert finish_reasons(reply) == ["length"] and reply[-1] == DONE
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["choices"][0]["token_ids"] == expected[0]
