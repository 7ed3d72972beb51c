"""The scheduler's rules with the real vLLM engine on CPU: budget, slices, preemption, stealing."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from bench.sse import sse_lines
from queues import intake
from queues.keys import Keys
from queues.messages import OutputEvent, SamplingSpec
from queues.replies import ReplyRouter
from tests.e2e.test_recovery import message_for
from tests.e2e.test_streaming import reference_ids
from tests.stack import running_stack, running_workers
from workers.engines.base import EngineDelta, OutputSink
from workers.engines.vllm_engine import VllmEngine
from workers.settings import WorkerSettings
from workers.worker import Worker

pytestmark = pytest.mark.engine


class PreemptAt:
    """The real engine, with the worker preempting one request as soon as it has consumed each of
    the given numbers of output tokens (counted over all its engine calls)."""

    def __init__(self, engine: VllmEngine, request_id: str, counts: list[int]) -> None:
        self._engine = engine
        self._request_id = request_id
        self.counts = counts
        self.worker: Worker | None = None
        self._consumed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        priority: int,
        cache_salt: str | None,
        sink: OutputSink,
    ) -> None:
        preempting = self

        class Counting:
            preempted = False  # what the engine sends after that, the worker no longer takes in

            def on_delta(self, delta: EngineDelta) -> None:
                if self.preempted:
                    return
                sink.on_delta(delta)  # the worker has taken the delta in
                if request_id.startswith(preempting._request_id):
                    self.preempted = preempting.consumed(len(delta.token_ids))

            def on_error(self, error: BaseException) -> None:
                sink.on_error(error)

        await self._engine.submit(
            request_id, prompt_token_ids, sampling, priority=priority, cache_salt=cache_salt, sink=Counting()
        )

    def consumed(self, num_tokens: int) -> bool:
        """Count what the worker took in; ``True`` if that preempted the request."""
        self._consumed += num_tokens
        if self.counts and self._consumed >= self.counts[0] and self.worker is not None:
            self.counts.pop(0)
            assert self.worker.preempt(self._request_id)
            return True
        return False


def worker_settings(redis_url: str, keys: Keys, **overrides: Any) -> WorkerSettings:
    overrides.setdefault("worker_id", f"w-{keys.prefix}")
    return WorkerSettings(redis_url=redis_url, key_prefix=keys.prefix, read_block_ms=100, **overrides)


async def test_engine_steps_follow_the_token_budget(engine: VllmEngine) -> None:
    spec = SamplingSpec(max_tokens=1, temperature=0.0)
    try:
        assert await engine.set_token_budget(512) == 512
        await engine.step_tokens()
        async for _ in engine.generate("budget-512", list(range(5, 1505)), spec, priority=0):
            pass
        small = await engine.step_tokens()
        assert await engine.set_token_budget(2048) == 2048
        async for _ in engine.generate("budget-2048", list(range(7, 1507)), spec, priority=0):
            pass
        large = await engine.step_tokens()
        # Never above the engine's start value: its buffers are sized for that.
        assert await engine.set_token_budget(100_000) == 2048
    finally:
        await engine.set_token_budget(2048)
    assert small == [512, 512, 476]
    assert large == [1500]


async def test_background_preempted_twice_and_sliced_matches_the_uninterrupted_generation(
    redis_url: str, engine: VllmEngine, setup: tuple[aioredis.Redis, Keys, ReplyRouter]
) -> None:
    redis, keys, router = setup
    prompt_ids = list(range(40, 100))
    expected = await reference_ids(engine, prompt_ids, 700, "reference-sliced")
    message = message_for(prompt_ids, 700)
    message.tier, message.bucket = "background", "long"
    reply = router.open(message.id)
    events: list[OutputEvent] = []
    # Inside the first slice, and inside the third: preempted by the worker's own count, not the
    # client's, which may lag the worker by more than the rest of a slice.
    preempting = PreemptAt(engine, message.id, [100, 450])
    async with running_workers([worker_settings(redis_url, keys)], preempting, redis_url) as (worker,):  # type: ignore[arg-type]
        preempting.worker = worker
        await intake.enqueue(redis, keys, message)
        async for event in reply.events():
            events.append(event)
        num_engine_calls, num_preempted = worker.num_engine_calls, worker.num_preempted
    assert preempting.counts == [], "a preemption point was never reached"
    reply.close()
    tokens = [token for event in events for token in event.token_ids]
    assert tokens == expected
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    assert [event.type for event in events].count("final") == 1 and events[-1].type == "final"
    assert events[-1].completion_tokens == 700
    assert num_preempted == 2
    # Engine calls of at most 256 tokens: 0-~100 (preempted), -~356, -~450 (preempted), -700.
    assert num_engine_calls == 4


async def test_realtime_starts_before_any_of_8_running_long_background_requests_finishes(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    background = {
        "model": "tiny",
        "prompt": "summarise these logs",
        "max_tokens": 600,
        "ignore_eos": True,
        "stream": True,
        "tier": "background",
    }
    finished_at: list[float] = []
    started = asyncio.Event()
    num_started = 0

    async def one_background(client: httpx.AsyncClient) -> None:
        nonlocal num_started
        first = True
        async with client.stream("POST", "/v1/completions", json=background) as response:
            async for line in sse_lines(response):
                if first and line.startswith("data: "):
                    first = False
                    num_started += 1
                    if num_started == 8:
                        started.set()
        finished_at.append(time.monotonic())

    # Eight slots: the background requests fill the engine, so the realtime one needs a preemption.
    async with running_stack(redis_url, tiny_model, engine, worker={"max_running": 8}) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            tasks = [asyncio.create_task(one_background(client)) for _ in range(8)]
            await asyncio.wait_for(started.wait(), timeout=60)
            body = {
                "model": "tiny",
                "prompt": "hi",
                "max_tokens": 4,
                "ignore_eos": True,
                "stream": True,
                "tier": "realtime",
            }
            first_token_at = None
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in sse_lines(response):
                    if line.startswith("data: ") and first_token_at is None:
                        first_token_at = time.monotonic()
            await asyncio.gather(*tasks)
        preempted = stack.workers[0].num_preempted
    assert first_token_at is not None
    assert len(finished_at) == 8
    assert first_token_at < min(finished_at), "a background request finished before the realtime one started"
    assert preempted >= 1


async def test_two_workers_with_different_home_buckets_steal_only_when_their_home_streams_are_empty(
    redis_url: str, engine: VllmEngine, setup: tuple[aioredis.Redis, Keys, ReplyRouter]
) -> None:
    redis, keys, router = setup
    shorts = [message_for(list(range(10, 20)), 16) for _ in range(8)]
    longs = [message_for(list(range(10, 30)), 16) for _ in range(2)]
    for message in longs:
        message.bucket = "long"
    streams = []
    for message in [*shorts, *longs]:
        streams.append(router.open(message.id))
        await intake.enqueue(redis, keys, message)
    short_home = worker_settings(redis_url, keys, home_buckets=["short"], max_running=1, worker_id="short-home")
    short_home.scheduler.prefetch = 2
    long_home = worker_settings(redis_url, keys, home_buckets=["long"], worker_id="long-home")
    async with running_workers([short_home, long_home], engine, redis_url) as workers:
        for stream in streams:
            async for _event in stream.events():
                pass
            stream.close()
    reads = Counter(request_id for worker in workers for request_id, _at in worker.accepted)
    bucket_of = {message.id: message.bucket for message in [*shorts, *longs]}
    assert reads == Counter(list(bucket_of)), "every request read exactly once overall"
    read_at = {request_id: at for worker in workers for request_id, at in worker.accepted}
    home_of = {"short-home": "short", "long-home": "long"}
    for worker in workers:
        home = home_of[worker.worker_id]
        assert all(bucket_of[request_id] != home for request_id in worker.stolen_ids)
        for request_id in worker.stolen_ids:
            # When this worker stole, every entry of its home bucket had already been read.
            home_entries = [other for other, bucket in bucket_of.items() if bucket == home]
            assert all(read_at[other] < read_at[request_id] for other in home_entries)
    # The long-bucket worker ran out of home work while short requests still waited: it stole.
    assert len(workers[1].stolen_ids) >= 1


async def test_the_worker_sets_the_engines_prefill_chunk_to_fit_the_realtime_prompts_it_sees(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    """After eight realtime prompts of 700 tokens the worker's scheduler asks for a prefill chunk that
    holds one whole (not the configured 256, nor the 512 it starts from) and the worker sets it in vLLM's engine core, where
    vLLM's scheduler reads it at every step."""
    body = {"model": "tiny", "max_tokens": 1, "tier": "realtime"}
    try:
        async with running_stack(redis_url, tiny_model, engine) as stack:
            (worker,) = stack.workers
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
                await client.post("/v1/completions", json={**body, "prompt": [5] * 20})
                # No realtime prompt seen: half the budget floor (1024), so lower tiers prefill two at a time.
                assert worker.prefill_chunk == 512 == await engine.prefill_chunk()
                for index in range(8):
                    answer = await client.post("/v1/completions", json={**body, "prompt": [index + 7] * 700})
                    assert answer.status_code == 200, answer.text
                await client.post("/v1/completions", json={**body, "prompt": [5] * 20})  # a round after them
            chunk = worker.prefill_chunk
            assert chunk == worker.scheduler.prefill_chunk_tokens
            in_engine = await engine.prefill_chunk()
    finally:
        await engine.set_prefill_chunk(256)  # the session's engine, as the other tests found it
    assert chunk is not None and 700 <= chunk <= 1024 and in_engine == chunk, (chunk, in_engine)
