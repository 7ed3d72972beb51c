"""Redis Sentinel, on real processes (a primary, a replica, three ``redis-sentinel``; ``tests.sentinel``),
without an engine: tailcut's clients follow a failover without a restart, the reply channel is
subscribed again on the new primary, the API answers 503 only while no primary is known, the jobs
process's arq loop outlives Redis errors, and ``replica`` intake durability refuses (and withdraws) a
request no replica confirmed. The streaming load through the API and workers is in
``tests/e2e/test_failover.py``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from arq.worker import func
from redis.exceptions import RedisError

from jobs.arq_worker import JobsWorker, close_worker, run_worker
from queues import intake
from queues.connection import connect, connect_blocking
from queues.intake import NotReplicatedError
from queues.jobs import connect_arq
from queues.keys import Keys
from queues.messages import OutputEvent
from queues.output import OutputWriter
from queues.replies import ReplyRouter
from tailcut.settings import CommonSettings, RedisEndpoint
from tests.integration.test_redis_contract import make_message
from tests.sentinel import SentinelGroup, sentinel_group
from tests.stack import running_stack, unique_prefix


@pytest.fixture
def group() -> AsyncIterator[SentinelGroup]:
    with sentinel_group() as started:
        yield started


async def eventually(condition: Callable[[], Awaitable[bool]], *, timeout_s: float, what: str) -> None:
    """Poll ``condition`` (a Redis error counts as not yet) until it holds; fail with ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(RedisError):
            if await condition():
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} after {timeout_s} s")


def test_settings_name_the_sentinels_and_refuse_a_bad_address() -> None:
    settings = CommonSettings(redis_sentinels=" 10.0.0.5:26379, sentinel-b:26380 ", redis_sentinel_password="pw")
    endpoint = settings.redis
    assert endpoint.sentinels == (("10.0.0.5", 26379), ("sentinel-b", 26380))
    assert endpoint.master == "mymaster" and endpoint.sentinel_password == "pw"
    assert str(endpoint) == "sentinel:mymaster@10.0.0.5:26379,sentinel-b:26380"
    assert str(RedisEndpoint("redis://api:secret@redis:6379/0")) == "redis://api:***@redis:6379/0"
    assert CommonSettings().redis.sentinels == ()
    with pytest.raises(ValueError, match="is not host:port"):
        CommonSettings(redis_sentinels="10.0.0.5")


async def test_a_client_follows_a_forced_failover_and_a_killed_primary(group: SentinelGroup) -> None:
    """One client through the Sentinels: its writes land on the primary; after ``SENTINEL FAILOVER``
    and after a SIGKILL of the next primary, the same client object reaches the new primary (a
    command may fail while the change happens; none is needed for long), and what was written
    before is there."""
    redis = connect(group.endpoint, timeout_s=1.0)
    try:
        first = await group.primary()
        await redis.set("before", b"1")
        assert await redis.info("server") and (await redis.config_get("port"))["port"] == str(first)
        group.failover()
        second = await group.primary(other_than=first)

        async def on(port: int) -> bool:
            return (await redis.config_get("port"))["port"] == str(port) and bool(await redis.set("x", b"1"))

        await eventually(lambda: on(second), timeout_s=15, what="the client did not reach the promoted replica")
        assert await redis.get("before") == b"1"
        group.kill(second)
        third = await group.primary(other_than=second, replicated=False)
        await eventually(lambda: on(third), timeout_s=20, what="the client did not reach the primary after a kill")
        assert third == first  # the old primary, a replica after the failover, is the only one left
    finally:
        await redis.aclose()


async def test_the_reply_channel_is_subscribed_again_on_the_new_primary(group: SentinelGroup) -> None:
    """The API's reply router (one pub/sub subscription per process) notices the failover, subscribes
    on the new primary, and a worker's events published there reach the open stream; anything
    published meanwhile is read from the durable output stream (gap fill)."""
    keys = Keys(unique_prefix())
    redis = connect(group.endpoint, timeout_s=1.0)
    pubsub = connect_blocking(group.endpoint, block_s=1.0, connect_timeout_s=1.0)
    router = ReplyRouter(redis, pubsub, keys, "api-1", poll_max_s=0.5)
    await router.start(wait_s=5)
    stream = router.open("r1")
    writer = OutputWriter(redis, keys, ttl_s=60)
    writer.start()
    try:
        writer.emit("api-1", OutputEvent(rid="r1", seq=1, type="chunk", text="a"))
        first = await group.primary()
        group.failover()
        await group.primary(other_than=first)
        for seq in range(2, 6):
            writer.emit("api-1", OutputEvent(rid="r1", seq=seq, type="chunk", text="b"))
            await asyncio.sleep(0.3)
        writer.emit("api-1", OutputEvent(rid="r1", seq=6, type="final", finish_reason="stop"))
        async with asyncio.timeout(20):
            events = [event async for event in stream.events()]
        assert [event.seq for event in events] == [1, 2, 3, 4, 5, 6]
        assert router.ready
    finally:
        await writer.close()
        await router.stop()
        await pubsub.aclose()
        await redis.aclose()


async def test_the_api_answers_503_only_while_no_primary_is_known(group: SentinelGroup, tiny_model: Path) -> None:
    """A SIGKILLed primary: while the Sentinels have not promoted the replica, ``/readyz`` reports Redis
    as the problem and a new request gets a 503 with an OpenAI-shaped error; once they have, the same
    API process answers again and accepts requests. (No worker runs here, so ``/readyz`` is 503 for
    that reason throughout: its problems say which.)"""
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "tier": "background", "stream": True}

    async def problems(client: httpx.AsyncClient) -> list[str]:
        problems: list[str] = (await client.get("/readyz")).json()["problems"]
        return problems

    async with running_stack(group.endpoint, tiny_model, None) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            assert await problems(client) == ["no live worker"]
            primary = await group.primary()
            group.kill(primary)
            down = await problems(client)
            refused = await client.post("/v1/completions", json=body)
            assert any(problem.startswith("redis:") for problem in down), down
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
            await group.primary(other_than=primary, replicated=False)

            async def ready() -> bool:
                return await problems(client) == ["no live worker"]

            await eventually(ready, timeout_s=20, what="the API did not reach the new primary")
            # Accepted again (no worker runs here: the stream waits, so only its status is read).
            async with client.stream("POST", "/v1/completions", json=body) as accepted:
                assert accepted.status_code == 200


async def test_replica_durability_refuses_and_withdraws_what_no_replica_confirmed(group: SentinelGroup) -> None:
    """With the replica stopped (SIGSTOP), ``WAIT 1`` times out: the enqueue raises, the entry is gone
    from its stream and a cancel tombstone stops any worker that read it. With the replica back,
    the same enqueue is acknowledged and the entry is on the replica."""
    keys = Keys(unique_prefix())
    redis = connect(group.endpoint, timeout_s=1.0)
    primary = await group.primary()
    (replica_port,) = [port for port in group.servers if port != primary]
    replica = group.servers[replica_port].process
    message = make_message(unique_prefix())
    stream = keys.intake(message.tier, message.bucket)
    try:
        await intake.ensure_groups(redis, keys)
        os.kill(replica.pid, signal.SIGSTOP)
        try:
            with pytest.raises(NotReplicatedError, match="no replica confirmed"):
                await intake.enqueue(redis, keys, message, replicas=1, wait_ms=100)
        finally:
            os.kill(replica.pid, signal.SIGCONT)
        assert await redis.xlen(stream) == 0
        assert await redis.get(keys.cancelled(message.id)) == b"1"
        entry_id = await intake.enqueue(redis, keys, message, replicas=1, wait_ms=500)
        on_replica = aioredis.Redis(host="127.0.0.1", port=replica_port)
        try:
            assert [row[0].decode() for row in await on_replica.xrange(stream)] == [entry_id]
        finally:
            await on_replica.aclose()
    finally:
        await redis.aclose()


async def test_the_jobs_process_arq_loop_outlives_a_failover(group: SentinelGroup) -> None:
    """arq's polling loop ends on the first Redis error; ``run_worker`` starts it again, so an arq worker
    on the Sentinel endpoint runs a job enqueued after its primary was SIGKILLed and replaced, in the
    same process and task."""
    queue = f"{unique_prefix()}arq"
    ran: list[str] = []

    async def note(ctx: dict[str, object], word: str) -> str:
        ran.append(word)
        return word

    pool = connect_arq(group.endpoint, queue_name=queue, timeout_s=1.0)
    worker = JobsWorker(functions=[func(note, name="note")], queue_name=queue, redis_pool=pool, handle_signals=False,
                    poll_delay=0.05, job_serializer=pool.job_serializer, job_deserializer=pool.job_deserializer)  # fmt: skip
    task = asyncio.create_task(run_worker(worker))
    try:
        await pool.enqueue_job("note", "before", _queue_name=queue)
        await eventually(lambda: _true(ran == ["before"]), timeout_s=10, what="the first job did not run")
        primary = await group.primary()
        group.kill(primary)
        await group.primary(other_than=primary, replicated=False)

        async def enqueued() -> bool:
            return await pool.enqueue_job("note", "after", _queue_name=queue) is not None

        await eventually(enqueued, timeout_s=20, what="no job could be enqueued on the new primary")
        await eventually(lambda: _true(ran == ["before", "after"]), timeout_s=20, what="the arq loop did not come back")
        assert not task.done()
    finally:
        await close_worker(worker, pool)
        await asyncio.gather(task, return_exceptions=True)


async def _true(value: bool) -> bool:
    return value
