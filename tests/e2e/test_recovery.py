"""A dead worker's requests are taken over: resumed without a gap or a repeat, or dead-lettered."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from queues import intake
from queues.keys import WORKER_GROUP, Keys
from queues.messages import OutputEvent, RequestMessage, SamplingSpec
from queues.output import OutputWriter
from queues.replies import ReplyRouter
from tests.e2e.conftest import API_ID
from tests.e2e.test_streaming import reference_ids
from tests.stack import running_workers
from workers.engines.vllm_engine import VllmEngine
from workers.settings import WorkerSettings

pytestmark = pytest.mark.engine


def message_for(prompt_ids: list[int], max_tokens: int) -> RequestMessage:
    now_ms = int(time.time() * 1000)
    return RequestMessage(
        id=uuid.uuid4().hex,
        tenant="t",
        tier="normal",
        bucket="short",
        prompt_token_ids=prompt_ids,
        sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        predicted_output_tokens=max_tokens,
        enqueued_at_ms=now_ms,
        deadline_ms=now_ms + 60_000,
        reply_to=API_ID,
    )


def fast_reclaim(redis_url: str, keys: Keys) -> WorkerSettings:
    # Deterministic fault injection: a tiny reclaim time instead of killing a process and waiting.
    return WorkerSettings(
        redis_url=redis_url,
        key_prefix=keys.prefix,
        worker_id="survivor",
        read_block_ms=100,
        heartbeat_s=0.05,
        reclaim_after_ms=200,
        reclaim_interval_s=0.1,
    )


async def test_dead_workers_request_is_resumed_with_no_gap_and_no_repeat(
    redis_url: str, tiny_model: Path, engine: VllmEngine, setup: tuple[aioredis.Redis, Keys, ReplyRouter]
) -> None:
    redis, keys, router = setup
    prompt_ids = list(range(10, 40))
    expected = await reference_ids(engine, prompt_ids, 40, "reference-reclaim")
    message = message_for(prompt_ids, 40)
    reply = router.open(message.id)
    await intake.enqueue(redis, keys, message)
    # A worker took the entry and streamed 12 tokens in three chunks, then died.
    (entry,) = await intake.read(redis, keys, "dead-worker", [keys.intake("normal", "short")], count=1, block_ms=None)
    writer = OutputWriter(redis, keys, ttl_s=60)
    writer.start()
    for seq, chunk in enumerate([expected[0:5], expected[5:9], expected[9:12]], start=1):
        writer.emit(API_ID, OutputEvent(rid=message.id, seq=seq, type="chunk", token_ids=chunk))
    await writer.close()

    async with running_workers([fast_reclaim(redis_url, keys)], engine, redis_url):
        events = [event async for event in reply.events()]
    reply.close()
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    assert [token for event in events for token in event.token_ids] == expected
    assert [event.type for event in events].count("final") == 1
    assert events[-1].completion_tokens == 40
    assert (await redis.xpending(entry.stream, WORKER_GROUP))["pending"] == 0


async def test_entry_delivered_too_often_goes_to_the_dead_letter_stream_with_one_error(
    redis_url: str, engine: VllmEngine, setup: tuple[aioredis.Redis, Keys, ReplyRouter]
) -> None:
    redis, keys, router = setup
    message = message_for([1, 2, 3], 8)
    reply = router.open(message.id)
    await intake.enqueue(redis, keys, message)
    stream = keys.intake("normal", "short")
    (entry,) = await intake.read(redis, keys, "dead-1", [stream], count=1, block_ms=None)
    # Two more workers took it over and died too: three deliveries so far.
    for consumer in ("dead-2", "dead-3"):
        await redis.xclaim(stream, WORKER_GROUP, consumer, min_idle_time=0, message_ids=[entry.entry_id])

    async with running_workers([fast_reclaim(redis_url, keys)], engine, redis_url):
        events = [event async for event in reply.events()]
        # The error is written first, then the entry moves to the dead-letter stream.
        deadline = time.monotonic() + 5
        while (await redis.xpending(stream, WORKER_GROUP))["pending"]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
    reply.close()
    assert [(event.type, event.error_code) for event in events] == [("error", "max_deliveries")]
    (dead,) = await redis.xrange(keys.dead_letter)
    assert dead[1][b"reason"] == b"max_deliveries"
    assert (await redis.xpending(stream, WORKER_GROUP))["pending"] == 0
