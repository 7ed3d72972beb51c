"""The worker's output path against a real Redis, with the zero-cost ``null`` engine: a busy worker
coalesces tokens into fewer events with every position exact, a finished request's entry goes with
its final event, a cancel heard just before its entry arrives, or left as a tombstone before the
read, still cancels it, an idle worker keeps its periodic work to about once a second, and a busy one
does it in the wake-ups the engine's output brings."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from queues import intake
from queues.connection import connect
from queues.keys import WORKER_GROUP, Keys
from queues.messages import RequestMessage, SamplingSpec
from queues.output import OutputWriter, read_output
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.stack import running_workers, unique_prefix
from workers import worker as worker_module
from workers.engines.base import Engine
from workers.engines.factory import start_engine
from workers.engines.filler import filler_token
from workers.settings import EngineSettings, WorkerSettings
from workers.ticks import Tick, Ticks


def message(request_id: str, *, max_tokens: int) -> RequestMessage:
    return RequestMessage(
        id=request_id,
        tenant="t",
        tier="normal",
        bucket="short",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingSpec(max_tokens=max_tokens, ignore_eos=True),
        predicted_output_tokens=max_tokens,
        enqueued_at_ms=int(time.time() * 1000),
        deadline_ms=int(time.time() * 1000) + 600_000,
        reply_to="api-under-test",
    )


def settings(redis_url: str, keys: Keys, model: Path, **overrides: object) -> WorkerSettings:
    overrides.setdefault("read_block_ms", 100)
    return WorkerSettings(
        redis_url=redis_url, key_prefix=keys.prefix, model=str(model), worker_id=f"w-{keys.prefix}",
        **overrides,  # type: ignore[arg-type]
    )  # fmt: skip


@contextlib.asynccontextmanager
async def null_engine_setup(
    redis_url: str, model: Path, engine_settings: EngineSettings
) -> AsyncIterator[tuple[Engine, Keys, aioredis.Redis]]:
    """A ``null`` engine, a fresh key prefix with its intake groups, and a Redis client; all of it
    gone afterwards."""
    engine = start_engine(engine_settings, model, TEST_MAX_MODEL_LEN)
    keys = Keys(unique_prefix())
    redis = connect(redis_url, timeout_s=5.0)
    try:
        await intake.ensure_groups(redis, keys)
        yield engine, keys, redis
    finally:
        await engine.shutdown()
        await _delete(redis, keys)


async def until(check: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.02)
    assert check(), what


async def test_a_busy_worker_coalesces_tokens_into_fewer_events_and_every_position_is_exact(
    redis_url: str, tiny_model: Path
) -> None:
    """Fifty replies of 200 tokens at once on an engine that costs nothing: the writer falls behind, so
    tokens join the chunk still waiting for it. Every reply is still every token once, in order, at
    gap-free positions ending in one final event, and its intake entry is gone with that event."""
    filler = filler_token(tiny_model)
    num_requests, num_tokens = 50, 200
    null = EngineSettings(kind="null", max_num_seqs=64)
    async with null_engine_setup(redis_url, tiny_model, null) as (engine, keys, redis):
        async with running_workers([settings(redis_url, keys, tiny_model, max_running=64)], engine, redis_url) as (
            worker,
        ):
            for index in range(num_requests):
                await intake.enqueue(redis, keys, message(f"busy-{index}", max_tokens=num_tokens))
            await until(lambda: len(worker.served_ids) == num_requests, timeout_s=60, what="every reply finished")
        num_events = 0
        for index in range(num_requests):
            events = await read_output(redis, keys, f"busy-{index}", from_seq=1)
            assert [event.seq for event in events] == list(range(1, len(events) + 1))
            assert [event.type for event in events] == ["chunk"] * (len(events) - 1) + ["final"]
            tokens = [token for event in events for token in event.token_ids]
            assert tokens == [filler.token_id] * num_tokens
            assert "".join(event.text for event in events) == filler.text * num_tokens
            assert events[-1].completion_tokens == num_tokens
            num_events += len(events)
        # Coalesced: far fewer events than tokens (one per token would be 50 x 201).
        assert num_events < num_requests * (num_tokens + 1) / 2, num_events
        stream = keys.intake("normal", "short")
        assert await redis.xlen(stream) == 0
        assert (await redis.xpending(stream, WORKER_GROUP))["pending"] == 0


async def test_a_cancel_heard_before_its_entry_arrives_still_cancels_it(redis_url: str, tiny_model: Path) -> None:
    """The cancel comes over the cancel channel while the read that brings its entry is on its way (no
    tombstone read with the entry): the worker remembers it, and the request ends ``cancelled``
    without running."""
    null = EngineSettings(kind="null", null_step_ms=5)
    async with null_engine_setup(redis_url, tiny_model, null) as (engine, keys, redis):
        async with running_workers([settings(redis_url, keys, tiny_model)], engine, redis_url) as (worker,):
            assert not await worker.cancel("early")  # nothing of it here yet
            await intake.enqueue(redis, keys, message("early", max_tokens=500))
            await until(lambda: worker.outcomes["cancelled"] == 1, timeout_s=20, what="the request cancelled")
        events = await read_output(redis, keys, "early", from_seq=1)
        assert [(event.seq, event.type, event.error_code) for event in events] == [(1, "error", "cancelled")]
        assert worker.num_engine_calls == 0


async def test_a_cancel_tombstone_found_with_the_delivery_cancels_the_request(redis_url: str, tiny_model: Path) -> None:
    """The client left before the read, and no worker heard its cancel (a tombstone only): the round
    trip that fences the delivery finds the tombstone, and the request ends with one ``cancelled``
    error without running."""
    null = EngineSettings(kind="null", null_step_ms=5)
    async with null_engine_setup(redis_url, tiny_model, null) as (engine, keys, redis):
        await redis.set(keys.cancelled("gone"), b"1", ex=60)
        await intake.enqueue(redis, keys, message("gone", max_tokens=500))
        async with running_workers([settings(redis_url, keys, tiny_model)], engine, redis_url) as (worker,):
            await until(lambda: worker.outcomes["cancelled"] == 1, timeout_s=20, what="the request cancelled")
            assert worker.outcomes["final"] == 0
        events = await read_output(redis, keys, "gone", from_seq=1)
        assert [(event.seq, event.type, event.error_code) for event in events] == [(1, "error", "cancelled")]
        assert worker.num_engine_calls == 0


async def test_after_a_read_that_empties_the_streams_the_next_waits_for_the_first_write(
    redis_url: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At light load the read that follows one that took everything waiting is sent once what was taken
    has written its first output (bounded by ``READ_AFTER_WRITE_MAX_S``, raised here so that the engine's
    slow first step cannot end the wait): preparing and sending it stays off the first token's path.
    The request is sent while a blocking read waits (the read that finds a stream empty): one sent during
    the worker's quick non-blocking read, on a loaded machine, is taken by it, and that read says nothing
    of the streams being emptied."""
    monkeypatch.setattr(worker_module, "READ_AFTER_WRITE_MAX_S", 30.0)
    order: list[str] = []
    read = intake.read
    blocking = asyncio.Event()

    async def recorded_read(*args: Any, **kwargs: Any) -> list[intake.IntakeEntry]:
        order.append("read")
        if kwargs["block_ms"] is not None:
            blocking.set()
        taken = await read(*args, **kwargs)
        if taken:
            order.append("took")
        return taken

    write_once = OutputWriter._write_once

    async def recorded_write(self: OutputWriter, batch: Any) -> list[tuple[str, int]]:
        fenced = await write_once(self, batch)
        order.append("wrote")
        return fenced

    monkeypatch.setattr(intake, "read", recorded_read)
    monkeypatch.setattr(OutputWriter, "_write_once", recorded_write)
    null = EngineSettings(kind="null", null_step_ms=200)
    async with null_engine_setup(redis_url, tiny_model, null) as (engine, keys, redis):
        worker_settings = settings(redis_url, keys, tiny_model, read_block_ms=2_000)
        async with running_workers([worker_settings], engine, redis_url) as (worker,):
            await until(blocking.is_set, timeout_s=20, what="the worker's first blocking read")
            await intake.enqueue(redis, keys, message("light", max_tokens=2))
            await until(lambda: worker.outcomes["final"] == 1, timeout_s=20, what="the request served")
    after = order[order.index("took") + 1 :]
    assert after.index("wrote") < after.index("read"), order


async def test_a_full_read_of_a_tier_is_admitted_before_the_next_read_counts_its_room(
    redis_url: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that fills a tier's local queue (``prefetch`` entries) is followed by a scheduling round
    before the next read: with the engine free, the round admits them, and the reader goes on taking that
    tier's entries. Counted before the round, the tier would look full, and the reader would block on the
    other tiers' empty streams for ``BLOCK_WHILE_FULL_MS`` after every ``prefetch`` entries."""
    prefetch = 4
    short_reads: list[int | None] = []
    read = intake.read

    async def recorded_read(*args: Any, **kwargs: Any) -> list[intake.IntakeEntry]:
        if kwargs.get("block_ms") == worker_module.BLOCK_WHILE_FULL_MS:
            short_reads.append(kwargs.get("block_ms"))
        return await read(*args, **kwargs)

    monkeypatch.setattr(intake, "read", recorded_read)
    null = EngineSettings(kind="null", null_step_ms=1)
    async with null_engine_setup(redis_url, tiny_model, null) as (engine, keys, redis):
        for index in range(8 * prefetch):
            await intake.enqueue(redis, keys, message(f"r{index}", max_tokens=50))
        worker_settings = settings(redis_url, keys, tiny_model, scheduler={"prefetch": prefetch})
        async with running_workers([worker_settings], engine, redis_url) as (worker,):
            await until(lambda: worker.outcomes["final"] == 8 * prefetch, timeout_s=30, what="every request served")
    assert short_reads == [], f"{len(short_reads)} reads blocked on the other tiers while the engine had room"


async def test_an_idle_worker_probes_and_schedules_about_once_a_second_and_still_serves(
    redis_url: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing running, waiting or kept, the backlog probe and the scheduling round come every
    ``IDLE_TICK_S`` (every 0.1 and 0.05 s while busy); an entry that arrives is served all the same,
    and the worker is quiet again after it."""
    probes: list[float] = []
    backlog = intake.backlog

    async def counted(redis: aioredis.Redis, streams: list[str]) -> dict[str, int]:
        probes.append(time.monotonic())
        return await backlog(redis, streams)

    monkeypatch.setattr(intake, "backlog", counted)
    null = EngineSettings(kind="null", null_step_ms=5)
    async with null_engine_setup(redis_url, tiny_model, null) as (engine, keys, redis):
        async with running_workers([settings(redis_url, keys, tiny_model)], engine, redis_url) as (worker,):
            rounds: list[float] = []
            schedule_round = worker._schedule_round

            async def counted_round() -> None:
                rounds.append(time.monotonic())
                await schedule_round()

            monkeypatch.setattr(worker, "_schedule_round", counted_round)
            for _ in range(2):
                await asyncio.sleep(0.5)  # the first pause after the last work
                start = len(probes), len(rounds)
                await asyncio.sleep(2.0)
                # At the busy pace: 20 probes and 40 rounds.
                assert len(probes) - start[0] <= 4 and len(rounds) - start[1] <= 4, (probes, rounds)
                await intake.enqueue(redis, keys, message(f"after-{len(probes)}", max_tokens=20))
                await until(lambda: len(worker.served_ids) == 1, timeout_s=20, what="the entry served")
                worker.served_ids.clear()


async def test_while_the_engine_streams_the_periodic_work_runs_in_its_wake_ups(
    redis_url: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduling tick and the backlog probe, due every 0.05 and 0.1 s while the worker is busy, run
    as the worker takes the engine's output (``Ticks.beat``) rather than on timers of their own, which
    would wake it between the engine's steps."""
    fired: list[tuple[float, str, str]] = []  # when, what ("round": the scheduling tick; "sleep"), how
    beating = False
    fire = Tick.fire

    def recorded_fire(self: Tick) -> None:
        if self.pending:
            what = "round" if getattr(self._callback, "__qualname__", "") == "Event.set" else "sleep"
            fired.append((time.monotonic(), what, "beat" if beating else "timer"))
        fire(self)

    monkeypatch.setattr(Tick, "fire", recorded_fire)
    null = EngineSettings(kind="null", null_step_ms=30)
    async with null_engine_setup(redis_url, tiny_model, null) as (engine, keys, redis):
        async with running_workers([settings(redis_url, keys, tiny_model)], engine, redis_url) as (worker,):
            beats: list[float] = []
            beat = Ticks.beat

            def recorded_beat(self: Ticks, now: float | None = None) -> None:
                nonlocal beating
                beats.append(time.monotonic())
                beating = True
                try:
                    beat(self, now)
                finally:
                    beating = False

            monkeypatch.setattr(Ticks, "beat", recorded_beat)
            await intake.enqueue(redis, keys, message("streaming", max_tokens=60))
            await until(lambda: worker.outcomes["final"] == 1, timeout_s=30, what="the request served")
    assert beats, "the worker never beat"
    streaming = [(what, how) for at, what, how in fired if beats[0] <= at <= beats[-1]]
    # About 1.8 s of steps: some 30 rounds and 15 probes, each due 0.05 or 0.1 s after the last.
    for what, least in (("round", 10), ("sleep", 5)):
        assert streaming.count((what, "beat")) >= least, fired
        assert streaming.count((what, "timer")) <= streaming.count((what, "beat")) // 5, fired


async def _delete(redis: aioredis.Redis, keys: Keys) -> None:
    names = [name async for name in redis.scan_iter(match=f"{keys.prefix}*")]
    if names:
        await redis.delete(*names)
    await redis.aclose()
