"""Deadlines mean "start by": a request that could not start in time is dead-lettered with one clear
error and costs no engine time; one that has started is never expired (tests/unit/test_lifecycle.py,
and the take-over tests of tests/e2e/test_recovery.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from bench.sse import sse_lines
from queues import intake
from queues.keys import WORKER_GROUP, Keys
from queues.replies import ReplyRouter
from tests.e2e.test_recovery import message_for
from tests.stack import running_stack, running_workers
from workers.engines.vllm_engine import VllmEngine
from workers.settings import WorkerSettings

pytestmark = pytest.mark.engine


async def test_a_request_whose_deadline_passed_before_it_started_is_dead_lettered_without_engine_time(
    redis_url: str, engine: VllmEngine, setup: tuple[aioredis.Redis, Keys, ReplyRouter]
) -> None:
    redis, keys, router = setup
    message = message_for(list(range(10, 20)), 16)
    message.deadline_ms = int(time.time() * 1000) - 1  # it waited too long for a worker
    reply = router.open(message.id)
    await intake.enqueue(redis, keys, message)
    settings = WorkerSettings(redis_url=redis_url, key_prefix=keys.prefix, worker_id="late", read_block_ms=100)
    async with running_workers([settings], engine, redis_url) as (worker,):
        events = [event async for event in reply.events()]
    reply.close()
    assert [(event.type, event.error_code) for event in events] == [("error", "expired")]
    assert events[0].error_message == "the request's deadline passed before it could start"
    assert worker.num_engine_calls == 0, "an expired request cost engine time"
    ((_id, fields),) = await redis.xrange(keys.dead_letter)
    assert fields[b"reason"] == b"expired"
    stream = keys.intake(message.tier, message.bucket)
    assert (await redis.xpending(stream, WORKER_GROUP))["pending"] == 0
    assert await redis.xlen(stream) == 0, "the expired entry is still queued"


async def test_an_expired_request_answers_504_and_a_stream_ends_with_the_error(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    """Through the API: a 0.2 s realtime deadline, and no worker until it has passed."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "tier": "realtime"}
    async with running_stack(redis_url, tiny_model, None, realtime_deadline_s=0.2) as stack:
        settings = WorkerSettings(
            redis_url=redis_url, key_prefix=stack.keys.prefix, worker_id="late", read_block_ms=100
        )
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
                assert streamed.status_code == 200
                whole = asyncio.create_task(client.post("/v1/completions", json=body))
                stream = stack.keys.intake("realtime", "short")
                while await stack.redis.xlen(stream) < 2:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)  # both deadlines pass with no worker
                async with running_workers([settings], engine, redis_url) as (worker,):
                    lines = [line async for line in sse_lines(streamed) if line.startswith("data: ")]
                    answered = await whole
    assert answered.status_code == 504, answered.text
    assert answered.json()["error"]["code"] == "expired"
    assert answered.json()["error"]["type"] == "timeout_error"
    assert '"code":"expired"' in lines[-2] and lines[-1] == "data: [DONE]"
    assert worker.num_engine_calls == 0
