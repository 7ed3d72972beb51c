"""Routing live output to the streams of one process (an API, a job runner), with gap fill from Redis.

One pub/sub subscription per process (``tc:reply:{api_id}``), made before any request is accepted;
each open request registers a ``ReplyStream`` before its intake entry is written. Pub/sub is
at-most-once, so a stream that sees a sequence gap, or hears nothing for a while, reads the missing
positions from the durable output stream ``tc:out:{id}``. Every position reaches the client once:
duplicates (by sequence number) are dropped. A stream that hears nothing and finds nothing new asks
its ``alive`` check whether the request still exists in Redis; if not (Redis lost it), it ends with a
``request_lost`` error instead of waiting for ever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from queues.keys import Keys
from queues.messages import OutputEvent, loads_events, lost_event
from queues.output import read_output
from tailcut.errors import ServiceUnavailableError
from tailcut.logs import log_event

log = logging.getLogger("tailcut.replies")

FIRST_POLL_S = 0.5
STOP_WAIT_S = 5.0


class ReplyStream:
    """The ordered, de-duplicated events of one request."""

    def __init__(
        self,
        router: ReplyRouter,
        request_id: str,
        *,
        next_seq: int = 1,
        alive: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.request_id = request_id
        self.next_seq = next_seq
        self._router = router
        self._alive = alive
        self._inbox: asyncio.Queue[OutputEvent | None] = asyncio.Queue()

    def deliver(self, event: OutputEvent | None) -> None:
        """Called by the router: a live event, or ``None`` to ask for a re-read from Redis."""
        self._inbox.put_nowait(event)

    async def events(self) -> AsyncIterator[OutputEvent]:
        """Yield events in sequence order, each once, until the terminal event."""
        async for batch in self.batches():
            for event in batch:
                yield event

    async def batches(self) -> AsyncIterator[list[OutputEvent]]:
        """The same events, grouped as they arrived together (never empty); the last list ends with the
        terminal event."""
        poll_s = FIRST_POLL_S
        while True:
            try:
                # Not asyncio.wait_for: on Python 3.11 it drops a cancellation that arrives together
                # with an event, and the consumer would read on to the end of the reply.
                async with asyncio.timeout(poll_s):
                    first = await self._inbox.get()
            except TimeoutError:
                first = None
                poll_s = min(poll_s * 2, self._router.poll_max_s)
            else:
                poll_s = FIRST_POLL_S
            batch = [first]
            while not self._inbox.empty():
                batch.append(self._inbox.get_nowait())
            ordered = await self._order(batch)
            if first is None and not ordered and not await self._still_there():
                yield [lost_event(self.request_id, self.next_seq)]
                return
            for position, event in enumerate(ordered):
                if event.terminal:
                    yield ordered[: position + 1]
                    return
            if ordered:
                yield ordered

    async def _still_there(self) -> bool:
        """Whether the request still exists in Redis (True when that cannot be told)."""
        if self._alive is None:
            return True
        try:
            return await self._alive()
        except RedisError:
            return True

    async def _order(self, batch: list[OutputEvent | None]) -> list[OutputEvent]:
        ordered: list[OutputEvent] = []
        for event in batch:
            if event is None or event.seq > self.next_seq:
                # A live event skipped ahead (a pub/sub message was lost) or nothing arrived: every
                # position up to the newest live one is already in the durable stream.
                stored = await self._router.read(self.request_id, from_seq=self.next_seq)
                for missing in stored:
                    if missing.seq == self.next_seq:
                        ordered.append(missing)
                        self.next_seq += 1
                        self._router.num_gap_filled += event is not None and missing.seq < event.seq
            elif event.seq == self.next_seq:
                ordered.append(event)
                self.next_seq += 1
        return ordered

    def close(self) -> None:
        self._router.close(self.request_id)


class ReplyRouter:
    """Owns this process's reply-channel subscription and the table of open streams."""

    def __init__(
        self, redis: aioredis.Redis, pubsub_redis: aioredis.Redis, keys: Keys, api_id: str, *, poll_max_s: float
    ) -> None:
        self._redis = redis
        self._pubsub_redis = pubsub_redis
        self._keys = keys
        self.channel = keys.reply_channel(api_id)
        self.poll_max_s = poll_max_s
        self._streams: dict[str, ReplyStream] = {}
        self._subscribed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.num_gap_filled = 0
        self._stopped = False

    async def start(self, *, wait_s: float) -> None:
        """Subscribe (in the background, reconnecting forever); wait up to ``wait_s`` for the first."""
        self._task = asyncio.create_task(self._listen(), name="reply-router")
        try:
            async with asyncio.timeout(wait_s):
                await self._subscribed.wait()
        except TimeoutError:
            log_event(log, "reply_channel_not_subscribed", logging.WARNING, channel=self.channel)

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            # The loop also ends by itself on _stopped, in case a library swallows the cancellation.
            await asyncio.wait([self._task], timeout=STOP_WAIT_S)

    @property
    def ready(self) -> bool:
        return self._subscribed.is_set()

    @property
    def num_open(self) -> int:
        return len(self._streams)

    def open(self, request_id: str, *, alive: Callable[[], Awaitable[bool]] | None = None) -> ReplyStream:
        """Register a stream; call before the intake entry is written so no event is missed. ``alive``:
        whether the request still exists in Redis (asked during silences)."""
        if not self._subscribed.is_set():
            raise ServiceUnavailableError("not subscribed to the reply channel yet (is Redis up?)")
        stream = ReplyStream(self, request_id, alive=alive)
        self._streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def read(self, request_id: str, *, from_seq: int) -> list[OutputEvent]:
        try:
            return await read_output(self._redis, self._keys, request_id, from_seq=from_seq)
        except RedisError as exc:
            log_event(log, "output_read_failed", logging.WARNING, rid=request_id, error=str(exc))
            return []

    def _dispatch(self, data: bytes) -> None:
        for event in loads_events(data):
            stream = self._streams.get(event.rid)
            if stream is not None:
                stream.deliver(event)

    async def _listen(self) -> None:
        reconnects = 0
        while not self._stopped:
            try:
                async with self._pubsub_redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.channel)
                    self._subscribed.set()
                    if reconnects:
                        # Anything published while we were away is only in the durable streams.
                        for stream in list(self._streams.values()):
                            stream.deliver(None)
                    while not self._stopped:
                        message = await pubsub.get_message(timeout=1.0)
                        if message is not None:
                            self._dispatch(message["data"])
            except RedisError as exc:
                self._subscribed.clear()
                reconnects += 1
                log_event(log, "reply_channel_reconnect", logging.WARNING, error=str(exc))
                await asyncio.sleep(0.2)
