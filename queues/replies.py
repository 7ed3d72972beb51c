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
import contextlib
import logging
import time
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
# How often the router looks for silent readers: a poll comes up to this much after its interval.
SWEEP_S = 0.1
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
        self._inbox: list[OutputEvent | None] = []
        # While the reader waits: what wakes it, since when, and after how long a silence it looks in Redis.
        self._waiter: asyncio.Future[None] | None = None
        self._waiting_since_s = 0.0
        self._poll_s = FIRST_POLL_S

    def deliver(self, event: OutputEvent | None) -> None:
        """Called by the router: a live event, or ``None`` to ask for a re-read from Redis."""
        self._inbox.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def poll(self, now_s: float, *, max_s: float) -> None:
        """Called by the router's sweep: a reader silent for its poll interval looks in Redis, and waits
        twice as long (up to ``max_s``) before the next look unless something arrives meanwhile."""
        if self._waiter is not None and not self._inbox and now_s - self._waiting_since_s >= self._poll_s:
            self._poll_s = min(self._poll_s * 2, max_s)
            self.deliver(None)

    async def events(self) -> AsyncIterator[OutputEvent]:
        """Yield events in sequence order, each once, until the terminal event."""
        async for batch in self.batches():
            for event in batch:
                yield event

    async def batches(self) -> AsyncIterator[list[OutputEvent]]:
        """The same events, grouped as they arrived together; the last list ends with the terminal event.
        An empty list says a look in Redis after a silence found nothing new: the request is still
        there, waiting or running (a reader that writes to a client may keep its connection alive)."""
        # No timer per wait: the router's sweep wakes a reader that has heard nothing for its poll interval.
        loop = asyncio.get_running_loop()
        while True:
            if not self._inbox:
                self._waiter = loop.create_future()
                self._waiting_since_s = time.monotonic()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            batch, self._inbox = self._inbox, []
            first = batch[0]
            if any(event is not None for event in batch):
                self._poll_s = FIRST_POLL_S
            ordered = await self._order(batch)
            if first is None and not ordered:
                if not await self._still_there():
                    yield [lost_event(self.request_id, self.next_seq)]
                    return
                yield []
                continue
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
        self._opened = asyncio.Event()  # a stream opened since the sweep found none
        self._subscribed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.num_gap_filled = 0
        self._stopped = False

    async def start(self, *, wait_s: float) -> None:
        """Subscribe (in the background, reconnecting forever); wait up to ``wait_s`` for the first."""
        self._task = asyncio.create_task(self._listen(), name="reply-router")
        self._sweeper = asyncio.create_task(self._sweep(), name="reply-sweep")
        try:
            async with asyncio.timeout(wait_s):
                await self._subscribed.wait()
        except TimeoutError:
            log_event(log, "reply_channel_not_subscribed", logging.WARNING, channel=self.channel)

    async def stop(self) -> None:
        self._stopped = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
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
        self._opened.set()
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def read(self, request_id: str, *, from_seq: int) -> list[OutputEvent]:
        try:
            return await read_output(self._redis, self._keys, request_id, from_seq=from_seq)
        except RedisError as exc:
            log_event(log, "output_read_failed", logging.WARNING, rid=request_id, error=str(exc))
            return []

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            if not self._streams:
                # No reader to look after: sleep until one opens, not ten wake-ups a second.
                self._opened.clear()
                await self._opened.wait()
                continue
            now_s = time.monotonic()
            for stream in list(self._streams.values()):
                stream.poll(now_s, max_s=self.poll_max_s)

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
