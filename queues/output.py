"""Output events: durable in ``tc:out:{id}``, live on the owning API's ``tc:reply:{api_id}``.

Every event is written to the request's output stream under the explicit stream id ``0-{seq}``, so
the stream doubles as an index by sequence number (a replay from ``seq`` is one XRANGE) and a
second write of the same position is refused by Redis itself. Pub/sub is at-most-once and only
ever a second copy: the API fills gaps from the stream.

Events produced while the previous write is in flight are flushed together: one script call
(``queues.fencing``) that writes the durable copies and sends one PUBLISH per API instance carrying
every event of the batch, which is what lets one API process take tens of thousands of chunks per
second. While a request's newest chunk still waits for that write (the writer is behind), its next
tokens join it (``unsent_chunk``) instead of taking a position of their own, as vLLM's
``stream_interval`` coalesces: a pipeline that falls behind the engine sends fewer, larger chunks
rather than falling further behind. Positions stay gap-free and exact; a chunk's text is the text of
its tokens. The script writes a request's events only while the writer holds the request's newest
fencing token: the events of a fenced request are dropped in Redis and the writer reports the
request (``on_fenced``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from queues import fencing, scripts
from queues.keys import WORKER_GROUP, Keys
from queues.messages import OutputEvent, lost_event

EVENT_FIELD = b"e"
log = logging.getLogger("tailcut.output")


# An intake entry to acknowledge with a request's terminal event: (stream, entry id).
Ack = tuple[str, str]


def stream_id(seq: int) -> str:
    return f"0-{seq}"


class OutputWriter:
    """Buffers events and writes them in batches from one background task.

    While Redis is down the writer retries with backoff instead of dropping events: a worker that
    cannot record its output must not acknowledge the request either.
    """

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int, on_fenced: Callable[[str, int], None] | None = None
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._ttl_s = ttl_s
        self._on_fenced = on_fenced
        self._pending: list[tuple[str, OutputEvent, int, Ack | None]] = []
        # Per request: its newest event while that is a chunk still in ``_pending``, and its token.
        self._unsent: dict[str, tuple[OutputEvent, int]] = {}
        self._num_emitted = 0
        self._num_written = 0
        self._wakeup = asyncio.Event()
        self._written = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="output-writer")

    async def close(self) -> None:
        """Write what is buffered, then stop."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task

    def emit(self, reply_to: str, event: OutputEvent, *, fence: int = 0, ack: Ack | None = None) -> None:
        """Queue ``event`` for the API instance ``reply_to``, written only while ``fence`` is the
        request's newest fencing token (0: unfenced). ``ack``: the request's intake entry, acknowledged
        and deleted in the same step as this (its terminal) event is written, saving the round trip
        of ``intake.ack``; a fenced request's is not (``on_fenced`` says so)."""
        self._pending.append((reply_to, event, fence, ack))
        if event.type == "chunk":
            self._unsent[event.rid] = (event, fence)
        else:
            self._unsent.pop(event.rid, None)
        self._num_emitted += 1
        self._wakeup.set()

    def unsent_chunk(self, request_id: str, fence: int = 0) -> OutputEvent | None:
        """The newest event of ``request_id`` (emitted under ``fence``) if it is a chunk that has not
        gone to Redis yet: new tokens may be added to it in place (``RequestLifecycle.on_output``)."""
        unsent = self._unsent.get(request_id)
        return unsent[0] if unsent is not None and unsent[1] == fence else None

    async def flush(self) -> None:
        """Wait until every event emitted so far is in Redis (before an XACK, say)."""
        await self._written_at_least(self._num_emitted)

    async def next_write(self, *, timeout_s: float) -> None:
        """Wait until the writer has put at least one more event in Redis than when called, at most
        ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._written_at_least(self._num_written + 1)

    async def _written_at_least(self, target: int) -> None:
        async with self._written:
            await self._written.wait_for(lambda: self._num_written >= target)

    async def _run(self) -> None:
        while not (self._closing and not self._pending):
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._pending:
                continue
            batch, self._pending = self._pending, []
            self._unsent.clear()
            try:
                await self._write(batch)
            except Exception:
                # Not a Redis outage (those are retried): a bug. The writer must outlive it, or every
                # later flush() would wait forever; the batch is lost and says so loudly.
                log.exception("output_write_dropped events=%d", len(batch))
            self._num_written += len(batch)
            async with self._written:
                self._written.notify_all()

    async def _write(self, batch: list[tuple[str, OutputEvent, int, Ack | None]]) -> None:
        delay_s = 0.05
        while True:
            try:
                fenced = await self._write_once(batch)
                break
            except RedisError as exc:
                log.warning("output_write_retry error=%s events=%d", exc, len(batch))
                await asyncio.sleep(delay_s)
                delay_s = min(1.0, delay_s * 2)
        for request_id, fence in fenced:
            log.warning("output_fenced rid=%s fence=%d", request_id, fence)
            if self._on_fenced is not None:
                self._on_fenced(request_id, fence)

    async def _write_once(self, batch: list[tuple[str, OutputEvent, int, Ack | None]]) -> list[tuple[str, int]]:
        """One script call for the batch; (request id, token) of the requests whose events were refused."""
        # Per request, in first-seen order: its channel, token and events (a request has one channel
        # and token), and the entry its terminal event acknowledges.
        requests: dict[str, tuple[str, int, list[OutputEvent]]] = {}
        acks: dict[str, Ack] = {}
        for reply_to, event, fence, ack in batch:
            requests.setdefault(event.rid, (reply_to, fence, []))[2].append(event)
            if ack is not None:
                acks[event.rid] = ack
        keys: list[str] = []
        args: list[str | int | bytes] = [self._ttl_s, len(requests), WORKER_GROUP]
        for request_id, (reply_to, fence, events) in requests.items():
            stream, entry_id = acks.get(request_id, (self._keys.output(request_id), ""))
            keys += [self._keys.fence(request_id), self._keys.output(request_id), stream]
            args += [fence, self._keys.reply_channel(reply_to), entry_id, len(events)]
            for event in events:
                args += [event.seq, event.dumps()]
        fenced = await scripts.run_packed(self._redis, fencing.WRITE_EVENTS, keys, args)
        order = list(requests.items())
        return [(order[int(index) - 1][0], order[int(index) - 1][1][1]) for index in fenced]


async def read_output(
    redis: aioredis.Redis, keys: Keys, request_id: str, *, from_seq: int, to_seq: int | None = None
) -> list[OutputEvent]:
    """Events of ``request_id`` with ``from_seq <= seq <= to_seq`` from the durable output stream."""
    end = stream_id(to_seq) if to_seq is not None else "+"
    rows = await redis.xrange(keys.output(request_id), min=stream_id(from_seq), max=end)
    return _events(rows)


async def follow_output(
    redis: aioredis.Redis,
    keys: Keys,
    request_id: str,
    *,
    after_seq: int,
    block_ms: int = 1000,
    alive: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncIterator[list[OutputEvent]]:
    """The events of ``request_id`` after position ``after_seq``, straight from the durable output
    stream (what a resume reads, on any API process): what is there, then each new batch as it is
    written (XREAD BLOCK on ``redis``, a blocking client), until the terminal event (again, when the
    client's position is already at or past it). While nothing arrives, ``alive()`` says whether
    there is still something to wait for (the request's record): if so, an empty batch says so after
    each blocking read (as ``ReplyStream.batches`` does: a reader writing to a client keeps its
    connection alive); if not, the reply ends with a ``request_lost`` error."""
    key = keys.output(request_id)
    last = stream_id(after_seq) if after_seq > 0 else "0-0"
    next_seq = after_seq + 1
    if after_seq > 0:
        # A client that already read the end (its reply finished, then it resumed from the last id it
        # saw) gets the terminal event once more and the stream closes: nothing comes after it.
        ended = await redis.xrevrange(key, count=1)
        if ended:
            (final,) = _events(ended)
            if final.terminal and final.seq <= after_seq:
                yield [final]
                return
    while True:
        reply = await redis.xread({key: last}, count=1000, block=block_ms)
        if not reply:
            if alive is not None and not await alive():
                yield [lost_event(request_id, next_seq)]
                return
            yield []
            continue
        rows = reply[0][1]
        events = _events(rows)
        last_id = rows[-1][0]
        last = last_id.decode() if isinstance(last_id, bytes) else str(last_id)
        next_seq = events[-1].seq + 1
        for position, event in enumerate(events):
            if event.terminal:
                yield events[: position + 1]
                return
        yield events


def _events(rows: Sequence[tuple[object, dict[bytes, bytes]]]) -> list[OutputEvent]:
    """The events of output-stream entries (XRANGE, XREVRANGE or XREAD rows)."""
    return [OutputEvent.from_dict(orjson.loads(fields[EVENT_FIELD])) for _id, fields in rows]


async def cancel(redis: aioredis.Redis, keys: Keys, request_id: str, *, ttl_s: int) -> None:
    """Tell every worker that ``request_id`` is cancelled; the tombstone covers not-yet-started work."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(keys.cancelled(request_id), b"1", ex=ttl_s)
        pipe.publish(keys.cancel_channel, request_id.encode())
        await pipe.execute()
