"""The Redis contract on a real Redis: gap fill, de-duplication, group recovery, eviction policy."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import orjson
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from admission.shedding import Backlog, ShedLimits
from queues import intake, scripts
from queues.connection import check_redis, connect, connect_blocking
from queues.keys import Keys
from queues.messages import OutputEvent, RequestMessage, SamplingSpec, dumps_events
from queues.output import EVENT_FIELD, OutputWriter, read_output, stream_id
from queues.replies import ReplyRouter
from tailcut.errors import ConfigError
from tests.stack import private_redis_server, unique_prefix

API_ID = "api-under-test"


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_url, timeout_s=1.0)
    yield client
    await client.aclose()


@pytest.fixture
async def router(redis: aioredis.Redis, redis_url: str) -> AsyncIterator[ReplyRouter]:
    pubsub = connect_blocking(redis_url, block_s=1.0, connect_timeout_s=1.0)
    replies = ReplyRouter(redis, pubsub, Keys(unique_prefix()), API_ID, poll_max_s=0.5)
    await replies.start(wait_s=5)
    assert replies.ready
    yield replies
    await replies.stop()
    await pubsub.aclose()


def chunk_events(request_id: str, count: int) -> list[OutputEvent]:
    events = [
        OutputEvent(rid=request_id, seq=seq, type="chunk", text=f"t{seq}", token_ids=[seq]) for seq in range(1, count)
    ]
    return [*events, OutputEvent(rid=request_id, seq=count, type="final", finish_reason="stop")]


async def store(redis: aioredis.Redis, keys: Keys, events: list[OutputEvent]) -> None:
    for event in events:
        await redis.xadd(keys.output(event.rid), {EVENT_FIELD: orjson.dumps(event)}, id=stream_id(event.seq))


async def collect(router: ReplyRouter, request_id: str) -> list[OutputEvent]:
    stream = router.open(request_id)
    try:
        return [event async for event in stream.events()]
    finally:
        stream.close()


async def test_dropped_pubsub_messages_are_filled_from_the_output_stream(
    redis: aioredis.Redis, router: ReplyRouter
) -> None:
    keys = router._keys
    events = chunk_events("req-gap", 6)
    await store(redis, keys, events)
    reader = asyncio.create_task(collect(router, "req-gap"))
    await asyncio.sleep(0.05)
    # Positions 3 and 4 are "lost" on pub/sub; 5 arrives twice.
    for seq in (1, 2, 5, 5, 6):
        await redis.publish(keys.reply_channel(API_ID), dumps_events([events[seq - 1]]))
    received = await asyncio.wait_for(reader, timeout=5)
    assert [event.seq for event in received] == [1, 2, 3, 4, 5, 6]
    assert [event.text for event in received[:5]] == ["t1", "t2", "t3", "t4", "t5"]
    assert router.num_gap_filled == 2
    await redis.delete(keys.output("req-gap"))


async def test_a_lost_final_event_is_found_by_polling_the_output_stream(
    redis: aioredis.Redis, router: ReplyRouter
) -> None:
    keys = router._keys
    events = chunk_events("req-lost-final", 3)
    await store(redis, keys, events)
    reader = asyncio.create_task(collect(router, "req-lost-final"))
    await asyncio.sleep(0.05)
    for event in events[:2]:
        await redis.publish(keys.reply_channel(API_ID), dumps_events([event]))
    received = await asyncio.wait_for(reader, timeout=5)
    assert [(event.seq, event.type) for event in received] == [(1, "chunk"), (2, "chunk"), (3, "final")]
    await redis.delete(keys.output("req-lost-final"))


async def test_a_reader_cancelled_as_an_event_arrives_stops(router: ReplyRouter) -> None:
    """A job runner cancels its readers while chunks keep arriving: the cancellation must win even
    when an event lands in the same loop turn (``asyncio.wait_for`` on Python 3.11 returned the
    event and dropped the cancellation, so an aborted job read on to the end of a long reply)."""
    stream = router.open("req-cancelled")
    received: list[OutputEvent] = []

    async def read() -> None:
        async for event in stream.events():
            received.append(event)

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.01)  # the reader waits for its first event
    events = chunk_events("req-cancelled", 3)
    stream.deliver(events[0])
    reader.cancel()
    await asyncio.wait([reader], timeout=2)
    stream.close()
    if not reader.done():
        reader.cancel()  # a second cancellation reaches it, so the test still ends
    assert reader.cancelled(), "the reader went on reading after it was cancelled"
    assert received == []


async def test_output_writer_publishes_live_and_refuses_a_second_write_of_a_position(
    redis: aioredis.Redis, router: ReplyRouter
) -> None:
    keys = router._keys
    writer = OutputWriter(redis, keys, ttl_s=60)
    writer.start()
    reader = asyncio.create_task(collect(router, "req-writer"))
    await asyncio.sleep(0.05)
    events = chunk_events("req-writer", 4)
    for event in events[:2]:
        writer.emit(API_ID, event)
    # A re-run after redelivery writes position 2 again, with other text: the first write stands.
    writer.emit(API_ID, OutputEvent(rid="req-writer", seq=2, type="chunk", text="again", token_ids=[99]))
    for event in events[2:]:
        writer.emit(API_ID, event)
    await writer.flush()
    received = await asyncio.wait_for(reader, timeout=5)
    await writer.close()
    stored = await read_output(redis, keys, "req-writer", from_seq=1)
    assert [event.seq for event in received] == [1, 2, 3, 4]
    assert [event.text for event in stored] == ["t1", "t2", "t3", ""]
    assert 0 < await redis.ttl(keys.output("req-writer")) <= 60
    await redis.delete(keys.output("req-writer"))


async def test_output_joins_a_chunk_only_until_the_writer_takes_it(redis: aioredis.Redis, router: ReplyRouter) -> None:
    keys = router._keys
    writer = OutputWriter(redis, keys, ttl_s=60)
    writer.start()
    reader = asyncio.create_task(collect(router, "req-join"))
    await asyncio.sleep(0.05)
    first = OutputEvent(rid="req-join", seq=1, type="chunk", text="a", token_ids=[1])
    writer.emit(API_ID, first, fence=0)
    # Not written yet: the request's next tokens may join it, under the same delivery's token only
    # (0 here: unfenced).
    assert writer.unsent_chunk("req-join", 0) is first
    assert writer.unsent_chunk("req-join", 4) is None and writer.unsent_chunk("other", 0) is None
    first.text += "b"
    first.token_ids += [2]
    await writer.flush()
    # Written: what comes next takes a position of its own.
    assert writer.unsent_chunk("req-join", 0) is None
    writer.emit(API_ID, OutputEvent(rid="req-join", seq=2, type="chunk", text="c", token_ids=[3]), fence=0)
    writer.emit(API_ID, OutputEvent(rid="req-join", seq=3, type="final", finish_reason="stop"), fence=0)
    # The final event is the newest: nothing may join a chunk behind it.
    assert writer.unsent_chunk("req-join", 0) is None
    await writer.flush()
    received = await asyncio.wait_for(reader, timeout=5)
    await writer.close()
    stored = await read_output(redis, keys, "req-join", from_seq=1)
    for events in (received, stored):
        assert [(event.seq, event.text, event.token_ids) for event in events] == [
            (1, "ab", [1, 2]),
            (2, "c", [3]),
            (3, "", []),
        ]
    await redis.delete(keys.output("req-join"))


def make_message(request_id: str) -> RequestMessage:
    return RequestMessage(
        id=request_id,
        tenant="t",
        tier="realtime",
        bucket="short",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingSpec(max_tokens=4),
        predicted_output_tokens=4,
        enqueued_at_ms=0,
        deadline_ms=1,
        reply_to=API_ID,
    )


async def test_the_output_writer_reloads_its_script_on_a_redis_that_lost_it(free_port: int) -> None:
    """A new primary after a failover, or a SCRIPT FLUSH, does not have the writer's script: the
    hand-packed EVALSHA (``queues.scripts.run_packed``) loads it again and the write goes through, on a
    single-connection client as the worker's and on a pooled one."""
    with private_redis_server(free_port) as server:
        pooled = connect(server.url, timeout_s=1.0)
        own = aioredis.Redis(connection_pool=pooled.connection_pool, single_connection_client=True)
        keys = Keys("tc:")
        try:
            for client, request_id in ((pooled, "pooled"), (own, "own")):
                writer = OutputWriter(client, keys, ttl_s=60)
                writer.start()
                async with asyncio.timeout(10):  # a writer that cannot write retries for ever
                    writer.emit(API_ID, OutputEvent(rid=request_id, seq=1, type="chunk", text="a", token_ids=[1]))
                    await writer.flush()
                    await pooled.script_flush()
                    writer.emit(API_ID, OutputEvent(rid=request_id, seq=2, type="final", finish_reason="stop"))
                    await writer.close()
                stored = await read_output(pooled, keys, request_id, from_seq=1)
                assert [(event.seq, event.type) for event in stored] == [(1, "chunk"), (2, "final")], request_id
        finally:
            await own.aclose()
            await pooled.aclose()


async def test_packed_commands_read_every_reply_and_raise_the_first_error(redis: aioredis.Redis) -> None:
    """``scripts.execute_packed_all`` (the intake's one round trip): an error reply in the middle is raised
    after the replies behind it are read, so the connection a later command gets is in step."""
    key = unique_prefix() + "packed"
    packed = b"".join(
        scripts.pack_command(command)
        for command in ([b"SET", key, b"v"], [b"LPUSH", key, b"x"], [b"APPEND", key, b"w"])
    )
    own = aioredis.Redis(connection_pool=redis.connection_pool, single_connection_client=True)
    try:
        for client in (redis, own):
            await redis.delete(key)
            with pytest.raises(ResponseError, match="WRONGTYPE"):
                await scripts.execute_packed_all(client, packed, num_replies=3)
            assert await client.get(key) == b"vw"  # the APPEND behind the error ran, and its reply was read
            assert await scripts.execute_packed_all(client, packed[: packed.index(b"*3", 1)], num_replies=1) == [b"OK"]
    finally:
        await own.aclose()
        await redis.delete(key)


async def test_consumer_group_is_recreated_after_flushall(free_port: int) -> None:
    with private_redis_server(free_port) as server:
        client = connect(server.url, timeout_s=1.0)
        keys = Keys("tc:")
        await intake.ensure_groups(client, keys)
        await client.flushall()
        # The API keeps enqueueing: XADD recreates the stream, but without the group.
        await intake.enqueue(client, keys, make_message("after-flush"))
        entries = await intake.read(client, keys, "w1", [keys.intake("realtime", "short")], count=10, block_ms=None)
        groups = await client.xinfo_groups(keys.intake("normal", "long"))
        await client.aclose()
    assert [entry.message.id for entry in entries] == ["after-flush"]
    assert entries[0].message.sampling.max_tokens == 4
    assert [group["name"] for group in groups] == [b"workers"]


async def test_redis_that_may_evict_is_refused_with_the_fix(free_port: int) -> None:
    with private_redis_server(free_port, "--maxmemory-policy", "allkeys-lru") as server:
        client = connect(server.url, timeout_s=1.0)
        with pytest.raises(ConfigError, match="CONFIG SET maxmemory-policy noeviction"):
            await check_redis(client)
        await client.aclose()


async def test_ack_deletes_the_entry_and_clears_the_pending_list(redis: aioredis.Redis) -> None:
    keys = Keys(unique_prefix())
    await intake.ensure_groups(redis, keys)
    await intake.enqueue(redis, keys, make_message("to-ack"))
    stream = keys.intake("realtime", "short")
    (entry,) = await intake.read(redis, keys, "w1", [stream], count=10, block_ms=None)
    assert (await redis.xpending(stream, "workers"))["pending"] == 1
    assert await intake.ack(redis, keys, entry)
    assert (await redis.xpending(stream, "workers"))["pending"] == 0
    assert await redis.xlen(stream) == 0
    await redis.delete(*keys.intake_all())


async def test_the_final_event_carries_the_acknowledgement_unless_fenced(redis: aioredis.Redis) -> None:
    """A request's final event and its entry's acknowledgement go to Redis in one step: the entry is
    acknowledged, deleted and its token dropped once the final event is written; a former owner's
    final event (another delivery holds the request) acknowledges nothing."""
    keys = Keys(unique_prefix())
    await intake.ensure_groups(redis, keys)
    stream = keys.intake("realtime", "short")
    for request_id in ("acked", "taken-over"):
        await intake.enqueue(redis, keys, make_message(request_id))
    acked, stale = await intake.read(redis, keys, "w1", [stream], count=10, block_ms=None)
    # Worker w2 takes the second entry over (w1 looked dead): a newer delivery, a newer token.
    await redis.xclaim(stream, "workers", "w2", min_idle_time=0, message_ids=[stale.entry_id])
    newer = intake.IntakeEntry(stream=stream, entry_id=stale.entry_id, message=stale.message)
    await intake.fence(redis, keys, [newer])
    assert newer.fence == stale.fence + 1
    fenced: list[tuple[str, int]] = []
    writer = OutputWriter(redis, keys, ttl_s=60, on_fenced=lambda rid, fence: fenced.append((rid, fence)))
    writer.start()
    for entry in (acked, stale):
        rid = entry.message.id
        writer.emit(API_ID, OutputEvent(rid=rid, seq=1, type="chunk", text="x", token_ids=[1]), fence=entry.fence)
        final = OutputEvent(rid=rid, seq=2, type="final", finish_reason="stop")
        writer.emit(API_ID, final, fence=entry.fence, ack=(entry.stream, entry.entry_id))
    await writer.flush()
    await writer.close()
    assert fenced == [("taken-over", stale.fence)]
    assert [event.type for event in await read_output(redis, keys, "acked", from_seq=1)] == ["chunk", "final"]
    assert await read_output(redis, keys, "taken-over", from_seq=1) == []
    # Only the taken-over entry is left, pending on its new owner, with its token.
    assert [entry_id.decode() for entry_id, _fields in await redis.xrange(stream)] == [stale.entry_id]
    pending = await redis.xpending_range(stream, "workers", min="-", max="+", count=10)
    assert [(row["message_id"].decode(), row["consumer"].decode()) for row in pending] == [(stale.entry_id, "w2")]
    assert not await redis.exists(keys.fence("acked")) and await redis.exists(keys.fence("taken-over"))
    await redis.delete(*keys.intake_all(), keys.output("acked"), keys.fence("taken-over"))


async def test_a_delivery_says_whether_a_cancel_tombstone_names_its_request(redis: aioredis.Redis) -> None:
    keys = Keys(unique_prefix())
    await intake.ensure_groups(redis, keys)
    stream = keys.intake("realtime", "short")
    await redis.set(keys.cancelled("left"), b"1", ex=60)
    for request_id in ("left", "stays"):
        await intake.enqueue(redis, keys, make_message(request_id))
    entries = await intake.read(redis, keys, "w1", [stream], count=10, block_ms=None)
    assert [(entry.message.id, entry.cancelled) for entry in entries] == [("left", True), ("stays", False)]
    await redis.delete(*keys.intake_all(), keys.cancelled("left"), keys.fence("left"), keys.fence("stays"))


async def test_a_fresh_entry_keeps_the_token_drawn_at_intake_only_from_the_time_its_reader_trusts(
    redis: aioredis.Redis,
) -> None:
    """An entry appended from the reader's trusted time on runs under the token drawn with it: no second
    token, and no tombstone read (the reader hears its cancels). One appended before is fenced as
    always: the next token, and its tombstone read."""
    keys = Keys(unique_prefix())
    await intake.ensure_groups(redis, keys)
    stream = keys.intake("realtime", "short")
    for request_id in ("before", "after"):
        await redis.set(keys.cancelled(request_id), b"1", ex=60)
        await intake.enqueue(redis, keys, make_message(request_id))
        await asyncio.sleep(0.005)
    after_ms = intake.entry_key((await redis.xrevrange(stream, count=1))[0][0])[0]
    asked: list[int] = []

    def trusted_from_ms() -> int:
        asked.append(after_ms)
        return after_ms

    entries = await intake.read(redis, keys, "w1", [stream], count=10, block_ms=None, trusted_from_ms=trusted_from_ms)
    assert asked == [after_ms], "asked once, after the read"
    assert [(entry.message.id, entry.fence, entry.cancelled) for entry in entries] == [
        ("before", 2, True),
        ("after", 1, False),
    ]
    assert [await redis.get(keys.fence(request_id)) for request_id in ("before", "after")] == [b"2", b"1"]
    await redis.delete(*keys.intake_all(), *(keys.cancelled(rid) for rid in ("before", "after")))
    await redis.delete(keys.fence("before"), keys.fence("after"))


@pytest.mark.parametrize("first_token", ["drawn at intake", "drawn by the reader"])
async def test_a_former_owner_is_fenced_off_once_its_entry_is_taken_over(
    redis: aioredis.Redis, router: ReplyRouter, first_token: str
) -> None:
    """Worker A reads a request and writes a chunk; worker B takes the entry over (A looked dead but
    is only slow). From then on nothing A writes reaches the output stream or the client, and A can
    neither requeue nor acknowledge the entry; B writes, and B acknowledges. The same whether A runs
    under the token drawn when the entry was appended or one it drew when it read the entry."""
    keys = router._keys
    await intake.ensure_groups(redis, keys)
    await intake.enqueue(redis, keys, make_message("fenced"))
    stream = keys.intake("realtime", "short")
    trusted = (lambda: 0) if first_token == "drawn at intake" else None
    (old,) = await intake.read(redis, keys, "slow-a", [stream], count=1, block_ms=None, trusted_from_ms=trusted)
    assert old.fence == (1 if trusted else 2)
    fenced: list[tuple[str, int]] = []
    slow_a = OutputWriter(redis, keys, ttl_s=60, on_fenced=lambda rid, fence: fenced.append((rid, fence)))
    b = OutputWriter(redis, keys, ttl_s=60)
    slow_a.start()
    b.start()
    reader = asyncio.create_task(collect(router, "fenced"))
    await asyncio.sleep(0.05)
    slow_a.emit(API_ID, OutputEvent(rid="fenced", seq=1, type="chunk", text="a1", token_ids=[1]), fence=old.fence)
    await slow_a.flush()

    (new,) = await intake.reclaim(redis, keys, "b", stream, min_idle_ms=0, count=1)
    await intake.fence(redis, keys, [new])
    assert new.fence == old.fence + 1
    slow_a.emit(API_ID, OutputEvent(rid="fenced", seq=2, type="chunk", text="a2", token_ids=[2]), fence=old.fence)
    await slow_a.flush()
    assert fenced == [("fenced", old.fence)]
    assert not await intake.keep_claimed(redis, keys, "b", [new])
    assert await intake.keep_claimed(redis, keys, "slow-a", [old]) == ["fenced"]
    assert await intake.requeue(redis, keys, old, make_message("fenced")) is None
    assert not await intake.ack(redis, keys, old)
    assert (await redis.xpending(stream, "workers"))["pending"] == 1, "the fenced ack acknowledged nothing"

    b.emit(API_ID, OutputEvent(rid="fenced", seq=2, type="chunk", text="b2", token_ids=[2]), fence=new.fence)
    b.emit(API_ID, OutputEvent(rid="fenced", seq=3, type="final", finish_reason="stop"), fence=new.fence)
    await b.flush()
    received = await asyncio.wait_for(reader, timeout=5)
    assert await intake.ack(redis, keys, new)
    await slow_a.close()
    await b.close()
    stored = await read_output(redis, keys, "fenced", from_seq=1)
    assert [event.text for event in stored] == ["a1", "b2", ""]
    assert [event.text for event in received] == ["a1", "b2", ""]
    assert (await redis.xpending(stream, "workers"))["pending"] == 0
    assert not await redis.exists(keys.fence("fenced")), "a finished request's token is dropped"
    # A worker's heartbeat can run between its acknowledgement and its letting the entry go: a finished
    # request is not one a newer delivery holds (that would log it as fenced, not finished).
    assert await intake.keep_claimed(redis, keys, "b", [new]) == []
    await redis.delete(keys.output("fenced"), *keys.intake_all())


async def test_backlog_counts_waiting_requests_and_retry_after_follows_the_drain_rate(redis: aioredis.Redis) -> None:
    keys = Keys(unique_prefix())
    backlog = Backlog(redis, keys, interval_s=1.0)
    stream = keys.intake("background", "long")
    try:
        for index in range(20):
            await redis.xadd(stream, {"d": b"x%d" % index})
        await backlog.probe()
        assert backlog.waiting("background") == 20  # no group yet: the whole stream waits
        assert backlog.retry_after_s("background", 10) == 30  # nothing drains: the longest wait
        await intake.ensure_groups(redis, keys)
        await redis.xreadgroup(intake.WORKER_GROUP, "w", {stream: ">"}, count=10)
        backlog.admitted("background", "long", await redis.xadd(stream, {"d": b"admitted"}))
        assert backlog.waiting("background") == 21  # counted at once, before the next probe
        await asyncio.sleep(0.2)
        await backlog.probe()
        assert backlog.waiting("background") == 11
        # 10 read in ~0.2 s: about 50/s smoothed by 0.05 → ~2.5/s; 2 excess requests → 1 s at most.
        assert 1 <= backlog.retry_after_s("background", 10) <= 2
        assert not ShedLimits(background=12).sheds("background", backlog.waiting("background"))
        assert ShedLimits(background=11).sheds("background", backlog.waiting("background"))
        assert not ShedLimits(background=0).sheds("background", 10_000)
    finally:
        await redis.delete(*keys.intake_all())


async def test_backlog_times_the_oldest_waiting_entry_in_the_servers_clock(redis: aioredis.Redis) -> None:
    """The wait is read in Redis's clock (an entry's id, which XADD stamps, against the server's TIME),
    so no host's clock is compared with it; between probes it grows by this host's time."""
    keys = Keys(unique_prefix())
    backlog = Backlog(redis, keys, interval_s=1.0)
    stream = keys.intake("normal", "medium")
    seconds, micros = await redis.time()
    now_ms = seconds * 1000 + micros // 1000
    try:
        for ago_ms in (3_000, 1_500, 0):  # entries stamped as if added that long ago
            await redis.xadd(stream, {"d": b"x"}, id=f"{now_ms - ago_ms}-0")
        await backlog.probe()
        assert 3_000 <= backlog.oldest_wait_ms("normal") < 3_200  # no group yet: the whole stream waits
        assert backlog.oldest_wait_ms("realtime") == 0
        await intake.ensure_groups(redis, keys)
        await redis.xreadgroup(intake.WORKER_GROUP, "w", {stream: ">"}, count=1)
        await backlog.probe()
        assert 1_500 <= backlog.oldest_wait_ms("normal") < 1_700  # the read one no longer counts
        await asyncio.sleep(0.3)
        assert 1_800 <= backlog.oldest_wait_ms("normal") < 2_100  # and the oldest keeps waiting
        await backlog.probe()
        assert 1_800 <= backlog.oldest_wait_ms("normal") < 2_100  # with no arrival since: the server's clock
        await redis.xreadgroup(intake.WORKER_GROUP, "w", {stream: ">"}, count=2)
        await backlog.probe()
        assert backlog.oldest_wait_ms("normal") == 0
    finally:
        await redis.delete(*keys.intake_all())


async def test_an_idle_backlog_probes_seldom_and_again_soon_after_an_admission(redis: aioredis.Redis) -> None:
    """Empty streams and nothing admitted: the probe waits ``idle_s``, not ``interval_s``; this process's
    next admission brings the next probe one interval later, and probes come every ``interval_s`` again
    while anything waits."""
    keys = Keys(unique_prefix())
    backlog = Backlog(redis, keys, interval_s=0.05, idle_s=60.0)
    stream = keys.intake("normal", "short")
    probes: list[float] = []
    probe = backlog.probe

    async def counted() -> None:
        await probe()
        probes.append(time.monotonic())

    backlog.probe = counted  # type: ignore[method-assign]
    try:
        await intake.ensure_groups(redis, keys)
        backlog.start()
        await asyncio.sleep(1.0)
        assert len(probes) == 1 and backlog.idle, probes  # every 0.05 s before: about 20
        backlog.admitted("normal", "short", await redis.xadd(stream, {"d": b"1"}))
        async with asyncio.timeout(30):  # not the 60 s of an idle wait
            while len(probes) < 2:
                await asyncio.sleep(0.01)
        assert backlog.depth["normal", "short"] == 1 and not backlog.idle
        async with asyncio.timeout(30):  # something waits: the short interval again
            while len(probes) < 5:
                await asyncio.sleep(0.01)
    finally:
        await backlog.stop()
        await redis.delete(*keys.intake_all())


async def test_backlog_counts_an_admission_once_however_its_xadd_and_the_probe_cross(redis: aioredis.Redis) -> None:
    """The API learns an entry's id only when its XADD returns, and a probe can run in between: the
    probe's count already holds the entry then, and the admission must not add it again."""
    keys = Keys(unique_prefix())
    backlog = Backlog(redis, keys, interval_s=1.0)
    stream = keys.intake("background", "short")
    try:
        await intake.ensure_groups(redis, keys)
        earlier = await redis.xadd(stream, {"d": b"1"})
        await backlog.probe()  # runs after the XADD, before the API hears of its id
        backlog.admitted("background", "short", earlier)
        assert backlog.waiting("background") == 1
        await backlog.probe()
        later = await redis.xadd(stream, {"d": b"2"})  # after the probe: on top of its count
        backlog.admitted("background", "short", later)
        assert backlog.waiting("background") == 2
        await backlog.probe()
        assert backlog.waiting("background") == 2
        # A read and acknowledged entry gone from the stream (the workers' XDEL) was counted as delivered.
        entries = await redis.xreadgroup(intake.WORKER_GROUP, "w", {stream: ">"}, count=2)
        await redis.xdel(stream, *[entry_id for entry_id, _ in entries[0][1]])
        gone = await redis.xadd(stream, {"d": b"3"})
        await redis.xreadgroup(intake.WORKER_GROUP, "w", {stream: ">"}, count=1)
        await redis.xdel(stream, gone)
        await backlog.probe()
        backlog.admitted("background", "short", gone)
        assert backlog.waiting("background") == 0
    finally:
        await redis.delete(*keys.intake_all())
