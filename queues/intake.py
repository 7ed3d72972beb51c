"""Intake streams: enqueue with XADD, read with XREADGROUP, acknowledge after the terminal event.

The consumer group is created idempotently with MKSTREAM; a ``NOGROUP`` reply (Redis restarted or
was flushed) recreates it and retries once.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from queues.keys import WORKER_GROUP, Keys
from queues.messages import RequestMessage

# Field of an intake entry that holds the orjson-encoded RequestMessage.
MESSAGE_FIELD = b"d"


@dataclass(slots=True)
class IntakeEntry:
    """An intake entry delivered to this consumer: where it came from and what it says."""

    stream: str
    entry_id: str
    message: RequestMessage
    delivery_count: int = 1


async def ensure_groups(redis: aioredis.Redis, keys: Keys) -> None:
    """Create the worker group on every intake stream (and the stream itself) if missing.

    The group starts at id 0, so entries written while the group was missing (after a FLUSHALL the
    API's XADD recreates the stream without a group) are still delivered.
    """
    for stream in keys.intake_all():
        try:
            await redis.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


async def enqueue(redis: aioredis.Redis, keys: Keys, message: RequestMessage) -> str:
    """Append the request to its intake stream; returns the entry id. Accepted once this returns."""
    entry_id = await redis.xadd(keys.intake(message.tier, message.bucket), {MESSAGE_FIELD: message.dumps()})
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


async def read(
    redis: aioredis.Redis,
    keys: Keys,
    consumer: str,
    streams: list[str],
    *,
    count: int,
    block_ms: int | None,
) -> list[IntakeEntry]:
    """Read up to ``count`` new entries per stream for ``consumer``; recreates a lost group once."""
    request: dict[bytes | str | memoryview, int | bytes | str | memoryview] = {stream: ">" for stream in streams}
    try:
        reply = await redis.xreadgroup(WORKER_GROUP, consumer, request, count=count, block=block_ms)
    except ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        await ensure_groups(redis, keys)
        reply = await redis.xreadgroup(WORKER_GROUP, consumer, request, count=count, block=block_ms)
    entries: list[IntakeEntry] = []
    for stream, items in reply or []:
        stream_name = stream.decode() if isinstance(stream, bytes) else stream
        for entry_id, fields in items:
            entries.append(
                IntakeEntry(
                    stream=stream_name,
                    entry_id=entry_id.decode(),
                    message=RequestMessage.loads(fields[MESSAGE_FIELD]),
                )
            )
    return entries


async def ack(redis: aioredis.Redis, entry: IntakeEntry) -> None:
    """Acknowledge and delete a finished entry: one group per stream, so nobody else needs it."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.xack(entry.stream, WORKER_GROUP, entry.entry_id)
        pipe.xdel(entry.stream, entry.entry_id)
        await pipe.execute()


async def dead_letter(redis: aioredis.Redis, keys: Keys, entry: IntakeEntry, reason: str) -> None:
    """Move an entry to the dead-letter stream with its reason, then acknowledge it."""
    await redis.xadd(
        keys.dead_letter,
        {b"reason": reason, b"stream": entry.stream, MESSAGE_FIELD: entry.message.dumps()},
        maxlen=100_000,
        approximate=True,
    )
    await ack(redis, entry)


async def keep_claimed(redis: aioredis.Redis, consumer: str, entries: list[IntakeEntry]) -> None:
    """Reset the idle time of entries this consumer is still working on, so nobody reclaims them."""
    by_stream: dict[str, list[int | bytes | str | memoryview]] = {}
    for entry in entries:
        by_stream.setdefault(entry.stream, []).append(entry.entry_id)
    if not by_stream:
        return
    async with redis.pipeline(transaction=False) as pipe:
        for stream, ids in by_stream.items():
            pipe.xclaim(stream, WORKER_GROUP, consumer, min_idle_time=0, message_ids=ids, justid=True)
        await pipe.execute()


async def reclaim(
    redis: aioredis.Redis, consumer: str, stream: str, *, min_idle_ms: int, count: int
) -> list[IntakeEntry]:
    """Take over up to ``count`` entries of ``stream`` idle longer than ``min_idle_ms`` (their
    consumer died or hangs); each comes with its delivery count, this delivery included."""
    reply = await redis.xautoclaim(stream, WORKER_GROUP, consumer, min_idle_ms, start_id="0-0", count=count)
    claimed = reply[1]
    entries: list[IntakeEntry] = []
    for entry_id, fields in claimed:
        if not fields:  # deleted while pending
            continue
        ident = entry_id.decode()
        info = await redis.xpending_range(stream, WORKER_GROUP, min=ident, max=ident, count=1)
        entries.append(
            IntakeEntry(
                stream=stream,
                entry_id=ident,
                message=RequestMessage.loads(fields[MESSAGE_FIELD]),
                delivery_count=int(info[0]["times_delivered"]) if info else 1,
            )
        )
    return entries


async def requeue(redis: aioredis.Redis, keys: Keys, entry: IntakeEntry, message: RequestMessage) -> str:
    """Replace ``entry`` by ``message`` (a continuation) at the end of its intake stream, atomically:
    the continuation exists exactly when the original is acknowledged."""
    stream = keys.intake(message.tier, message.bucket)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.xadd(stream, {MESSAGE_FIELD: message.dumps()})
        pipe.xack(entry.stream, WORKER_GROUP, entry.entry_id)
        pipe.xdel(entry.stream, entry.entry_id)
        new_id, _acked, _deleted = await pipe.execute()
    return new_id.decode() if isinstance(new_id, bytes) else str(new_id)


async def backlog(redis: aioredis.Redis, streams: list[str]) -> dict[str, int]:
    """Entries of each stream not yet delivered to any worker (the group's lag, or the stream's length
    while it has no group)."""
    async with redis.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xinfo_groups(stream)
        replies = await pipe.execute(raise_on_error=False)
    lags: dict[str, int] = {}
    for stream, groups in zip(streams, replies, strict=True):
        if isinstance(groups, Exception):
            continue
        for group in groups:
            if group.get("name") in (WORKER_GROUP, WORKER_GROUP.encode()):
                lags[stream] = int(group.get("lag") or 0)
    # A stream no worker has opened yet has no group: the group will start at id 0, so every entry
    # in it is still to be delivered.
    missing = [stream for stream in streams if stream not in lags]
    if missing:
        async with redis.pipeline(transaction=False) as pipe:
            for stream in missing:
                pipe.xlen(stream)
            lags.update(zip(missing, map(int, await pipe.execute()), strict=True))
    return lags
