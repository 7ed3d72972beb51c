"""The worker loop: take entries from the intake streams, run them in the engine, stream the output.

One worker process owns one engine. Entries are read with XREADGROUP in urgency order (realtime
before normal before background, short before long) while the worker has free slots; each runs in
its own task until its terminal event is written, and only then is it acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import replace

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from queues import intake
from queues.intake import IntakeEntry
from queues.keys import Keys, Tier
from queues.messages import OutputEvent
from queues.output import OutputWriter, read_output
from tailcut.errors import EngineDeadError, InvalidRequestError
from tailcut.logs import log_event
from workers.engines.base import Engine
from workers.settings import WorkerSettings

log = logging.getLogger("tailcut.worker")

# The tier is the engine's request priority (lower runs first).
TIER_PRIORITY: dict[Tier, int] = {"realtime": 0, "normal": 1, "background": 2}
# Worker heartbeats older than this are pruned from the live-worker set.
STALE_WORKER_S = 60
SERVED_IDS_KEPT = 10_000


def now_ms() -> int:
    return int(time.time() * 1000)


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        redis: aioredis.Redis,
        blocking_redis: aioredis.Redis,
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._redis = redis
        self._blocking = blocking_redis
        self._keys = Keys(settings.key_prefix)
        self._writer = OutputWriter(redis, self._keys, ttl_s=settings.output_ttl_s)
        self._running: dict[str, asyncio.Task[None]] = {}
        self._entries: dict[str, IntakeEntry] = {}
        self._cancel_requested: set[str] = set()
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._fatal: BaseException | None = None
        # Ids of the requests this worker brought to a terminal state, newest last (bounded).
        self.served_ids: deque[str] = deque(maxlen=SERVED_IDS_KEPT)

    @property
    def worker_id(self) -> str:
        return self._settings.worker_id

    @property
    def running_ids(self) -> list[str]:
        return list(self._running)

    def stop(self) -> None:
        """Ask the worker to stop reading; running requests get ``drain_timeout_s`` to finish."""
        self._stopping.set()

    async def run(self) -> None:
        """Serve until ``stop()``; raises the fatal error that stopped it, if any."""
        await intake.ensure_groups(self._redis, self._keys)
        self._writer.start()
        helpers = [
            asyncio.create_task(self._heartbeat(), name="worker-heartbeat"),
            asyncio.create_task(self._listen_for_cancels(), name="worker-cancels"),
            asyncio.create_task(self._reclaim_loop(), name="worker-reclaim"),
        ]
        log_event(log, "worker_started", worker=self.worker_id, max_running=self._settings.num_running_max)
        try:
            await self._read_loop()
        finally:
            await self._drain()
            for task in reversed(helpers):
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            await self._writer.close()
            with contextlib.suppress(RedisError):
                await self._redis.zrem(self._keys.workers, self.worker_id)
            log_event(log, "worker_stopped", worker=self.worker_id, served=len(self.served_ids))
        if self._fatal is not None:
            raise self._fatal

    async def _read_loop(self) -> None:
        streams = self._keys.intake_all()
        max_running = self._settings.num_running_max
        while not self._stopping.is_set():
            free = max_running - len(self._running)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                entries = await self._take(streams, free)
            except RedisError as exc:
                log_event(log, "intake_read_failed", logging.WARNING, error=str(exc))
                await asyncio.sleep(0.5)
                continue
            for entry in entries:
                self._start(entry)

    def _start(self, entry: IntakeEntry) -> None:
        self._entries[entry.message.id] = entry
        self._running[entry.message.id] = asyncio.create_task(self._serve(entry), name=f"serve-{entry.message.id}")

    async def _take(self, streams: list[str], free: int) -> list[IntakeEntry]:
        """Most urgent first: non-blocking reads stream by stream, then one blocking read on all."""
        taken: list[IntakeEntry] = []
        for stream in streams:
            if free - len(taken) <= 0:
                return taken
            taken += await intake.read(
                self._redis, self._keys, self.worker_id, [stream], count=free - len(taken), block_ms=None
            )
        if taken:
            return taken
        return await intake.read(
            self._blocking,
            self._keys,
            self.worker_id,
            streams,
            count=1,
            block_ms=self._settings.read_block_ms,
        )

    async def _serve(self, entry: IntakeEntry) -> None:
        message = entry.message
        seq = message.next_seq
        started_ms = now_ms()
        outcome = "final"

        def emit(event: OutputEvent) -> None:
            self._writer.emit(message.reply_to, event)

        try:
            if await self._redis.exists(self._keys.cancelled(message.id)):
                outcome = "cancelled"
                emit(_error(message.id, seq, "cancelled", "the client cancelled the request"))
                return
            if started_ms > message.deadline_ms:
                outcome = "expired"
                emit(_error(message.id, seq, "expired", "the request's deadline passed before it could run"))
                await self._writer.flush()
                await intake.dead_letter(self._redis, self._keys, entry, "expired")
                return
            generated = list(message.generated_token_ids)
            sampling = replace(message.sampling, max_tokens=message.sampling.max_tokens - len(generated))
            finish_reason = "stop"
            async for delta in self._engine.generate(
                message.id,
                message.prompt_token_ids + generated,
                sampling,
                priority=TIER_PRIORITY[message.tier],
            ):
                if delta.token_ids or delta.text:
                    emit(OutputEvent(rid=message.id, seq=seq, type="chunk", text=delta.text, token_ids=delta.token_ids))
                    seq += 1
                    generated += delta.token_ids
                if delta.finish_reason is not None:
                    finish_reason = delta.finish_reason
            emit(
                OutputEvent(
                    rid=message.id,
                    seq=seq,
                    type="final",
                    finish_reason=finish_reason,
                    prompt_tokens=len(message.prompt_token_ids),
                    completion_tokens=len(generated),
                )
            )
        except asyncio.CancelledError:
            if message.id in self._cancel_requested:
                outcome = "cancelled"
                emit(_error(message.id, seq, "cancelled", "the client cancelled the request"))
            else:
                # The worker is stopping: leave the entry pending; another worker takes it over
                # after reclaim_after_ms and resumes from the output already written.
                outcome = "abandoned"
        except InvalidRequestError as exc:
            outcome = "invalid"
            emit(_error(message.id, seq, "invalid_request", exc.message))
        except EngineDeadError as exc:
            outcome = "engine_dead"
            emit(_error(message.id, seq, "engine_dead", "the inference engine failed; retry the request"))
            self._fatal = exc
            self._stopping.set()
        finally:
            await self._finish(entry, outcome, started_ms)

    async def _finish(self, entry: IntakeEntry, outcome: str, started_ms: int) -> None:
        message = entry.message
        try:
            await self._writer.flush()
            if outcome not in ("expired", "abandoned"):
                await intake.ack(self._redis, entry)
        except RedisError as exc:
            # Left pending: it will be redelivered, and its written positions are de-duplicated.
            log_event(log, "ack_failed", logging.WARNING, rid=message.id, error=str(exc))
        finally:
            self._running.pop(message.id, None)
            self._entries.pop(message.id, None)
            self._cancel_requested.discard(message.id)
            self._slot_freed.set()
            self.served_ids.append(message.id)
        log_event(
            log,
            "request_finished",
            rid=message.id,
            tier=message.tier,
            bucket=message.bucket,
            outcome=outcome,
            wait_ms=started_ms - message.enqueued_at_ms,
            run_ms=now_ms() - started_ms,
        )

    async def _drain(self) -> None:
        if not self._running:
            return
        tasks = list(self._running.values())
        _done, pending = await asyncio.wait(tasks, timeout=self._settings.drain_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _heartbeat(self) -> None:
        while True:
            try:
                now = time.time()
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.zadd(self._keys.workers, {self.worker_id: now})
                    pipe.zremrangebyscore(self._keys.workers, 0, now - STALE_WORKER_S)
                    await pipe.execute()
                await intake.keep_claimed(self._redis, self.worker_id, list(self._entries.values()))
            except RedisError as exc:
                log_event(log, "heartbeat_failed", logging.WARNING, error=str(exc))
            await asyncio.sleep(self._settings.heartbeat_s)

    async def _listen_for_cancels(self) -> None:
        while True:
            try:
                async with self._blocking.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self._keys.cancel_channel)
                    while True:
                        message = await pubsub.get_message(timeout=1.0)
                        if message is not None:
                            self.cancel(message["data"].decode())
            except RedisError as exc:
                log_event(log, "cancel_listener_reconnect", logging.WARNING, error=str(exc))
                await asyncio.sleep(0.5)

    async def _reclaim_loop(self) -> None:
        if not self._settings.reclaim_after_ms:
            return
        while True:
            await asyncio.sleep(self._settings.reclaim_interval_s)
            if self._stopping.is_set():
                return
            try:
                await self.reclaim_once()
            except RedisError as exc:
                log_event(log, "reclaim_failed", logging.WARNING, error=str(exc))

    async def reclaim_once(self) -> int:
        """Take over entries of dead workers (idle past ``reclaim_after_ms``); returns how many."""
        taken = 0
        for stream in self._keys.intake_all():
            free = self._settings.num_running_max - len(self._running)
            if free <= 0:
                break
            entries = await intake.reclaim(
                self._redis, self.worker_id, stream, min_idle_ms=self._settings.reclaim_after_ms, count=free
            )
            for entry in entries:
                taken += 1
                await self._take_over(entry)
        return taken

    async def _take_over(self, entry: IntakeEntry) -> None:
        message = entry.message
        written = await read_output(self._redis, self._keys, message.id, from_seq=1)
        log_event(
            log,
            "request_reclaimed",
            rid=message.id,
            tier=message.tier,
            deliveries=entry.delivery_count,
            positions_written=len(written),
        )
        if any(event.terminal for event in written):
            # It finished; only the acknowledgement was lost.
            await intake.ack(self._redis, entry)
            return
        next_seq = written[-1].seq + 1 if written else message.next_seq
        if entry.delivery_count > self._settings.max_deliveries:
            self._writer.emit(
                message.reply_to,
                _error(
                    message.id,
                    next_seq,
                    "max_deliveries",
                    f"the request was delivered {entry.delivery_count} times without finishing",
                ),
            )
            await self._writer.flush()
            await intake.dead_letter(self._redis, self._keys, entry, "max_deliveries")
            return
        # Resume where the output stops: the prompt plus every token the client already has.
        entry.message = replace(
            message,
            generated_token_ids=[token for event in written if event.type == "chunk" for token in event.token_ids]
            or message.generated_token_ids,
            next_seq=next_seq,
            attempt=message.attempt + 1,
        )
        self._start(entry)

    def cancel(self, request_id: str) -> bool:
        """Abort a running request (the engine iteration is cancelled, which aborts it in vLLM)."""
        task = self._running.get(request_id)
        if task is None:
            return False
        self._cancel_requested.add(request_id)
        task.cancel()
        return True


def _error(rid: str, seq: int, code: str, message: str) -> OutputEvent:
    return OutputEvent(rid=rid, seq=seq, type="error", error_code=code, error_message=message)
