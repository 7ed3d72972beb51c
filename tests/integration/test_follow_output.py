"""A resume reads the durable output stream (``queues.output.follow_output``, real Redis): from a position
inside the reply it gets the rest up to the terminal event; from the terminal event itself (a client whose
reply had finished resumes from the last id it saw) it gets that event again at once and the reply ends,
where it once waited for more events that never come."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from queues import output
from queues.connection import connect_blocking
from queues.keys import Keys
from queues.messages import OutputEvent
from queues.output import OutputWriter


async def test_a_resume_from_inside_or_at_the_end_of_a_finished_reply_ends_at_once(
    prefixed_redis: tuple[aioredis.Redis, Keys], redis_url: str
) -> None:
    redis, keys = prefixed_redis
    writer = OutputWriter(redis, keys, ttl_s=60)
    writer.start()
    writer.emit("api-1", OutputEvent(rid="r1", seq=1, type="chunk", text="hi"))
    writer.emit("api-1", OutputEvent(rid="r1", seq=2, type="chunk", text=" there"))
    writer.emit("api-1", OutputEvent(rid="r1", seq=3, type="final", finish_reason="stop"))
    await writer.flush()
    await writer.close()
    blocking = connect_blocking(redis_url, block_s=1.0, connect_timeout_s=2.0)
    try:
        for after_seq, expected in ((0, [1, 2, 3]), (1, [2, 3]), (3, [3]), (7, [3])):
            async with asyncio.timeout(5):  # at the end it waited for ever
                batches = [batch async for batch in output.follow_output(blocking, keys, "r1", after_seq=after_seq)]
            assert [event.seq for batch in batches for event in batch] == expected, after_seq
            assert batches[-1][-1].type == "final"
    finally:
        await blocking.aclose()
