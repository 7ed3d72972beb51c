"""A dead worker's requests are taken over: resumed without a gap or a repeat, or dead-lettered."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from bench.sse import sse_lines
from queues import intake
from queues.keys import WORKER_GROUP, Keys
from queues.messages import OutputEvent, RequestMessage, SamplingSpec
from queues.output import OutputWriter
from queues.replies import ReplyRouter
from tests.conftest import TEST_KV_CACHE_BYTES, TEST_MAX_MODEL_LEN
from tests.e2e.conftest import API_ID
from tests.e2e.test_streaming import reference_ids
from tests.procs import descendants
from tests.procs import processes as live_processes
from tests.sse import DONE, finish_reasons, stream_events, streamed_token_ids
from tests.stack import running_stack, running_workers
from workers.engines.vllm_engine import VllmEngine
from workers.settings import WorkerSettings

pytestmark = pytest.mark.engine


def message_for(prompt_ids: list[int], max_tokens: int) -> RequestMessage:
    now_ms = int(time.time() * 1000)
    return RequestMessage(
        id=uuid.uuid4().hex,
        tenant="t",
        tier="normal",
        bucket="short",
        prompt_token_ids=prompt_ids,
        sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        predicted_output_tokens=max_tokens,
        enqueued_at_ms=now_ms,
        deadline_ms=now_ms + 60_000,
        reply_to=API_ID,
    )


def fast_reclaim(redis_url: str, keys: Keys) -> WorkerSettings:
    # Deterministic fault injection: a tiny reclaim time instead of killing a process and waiting.
    return WorkerSettings(
        redis_url=redis_url,
        key_prefix=keys.prefix,
        worker_id="survivor",
        read_block_ms=100,
        heartbeat_s=0.05,
        reclaim_after_ms=200,
        reclaim_interval_s=0.1,
    )


async def test_dead_workers_request_is_resumed_with_no_gap_and_no_repeat(
    redis_url: str, tiny_model: Path, engine: VllmEngine, setup: tuple[aioredis.Redis, Keys, ReplyRouter]
) -> None:
    redis, keys, router = setup
    prompt_ids = list(range(10, 40))
    expected = await reference_ids(engine, prompt_ids, 40, "reference-reclaim")
    message = message_for(prompt_ids, 40)
    reply = router.open(message.id)
    await intake.enqueue(redis, keys, message)
    # A worker took the entry and streamed 12 tokens in three chunks, then died.
    (entry,) = await intake.read(redis, keys, "dead-worker", [keys.intake("normal", "short")], count=1, block_ms=None)
    writer = OutputWriter(redis, keys, ttl_s=60)
    writer.start()
    for seq, chunk in enumerate([expected[0:5], expected[5:9], expected[9:12]], start=1):
        writer.emit(API_ID, OutputEvent(rid=message.id, seq=seq, type="chunk", token_ids=chunk))
    await writer.close()

    async with running_workers([fast_reclaim(redis_url, keys)], engine, redis_url):
        events = [event async for event in reply.events()]
    reply.close()
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    assert [token for event in events for token in event.token_ids] == expected
    assert [event.type for event in events].count("final") == 1
    assert events[-1].completion_tokens == 40
    assert (await redis.xpending(entry.stream, WORKER_GROUP))["pending"] == 0


async def test_entry_delivered_too_often_goes_to_the_dead_letter_stream_with_one_error(
    redis_url: str, engine: VllmEngine, setup: tuple[aioredis.Redis, Keys, ReplyRouter]
) -> None:
    redis, keys, router = setup
    message = message_for([1, 2, 3], 8)
    reply = router.open(message.id)
    await intake.enqueue(redis, keys, message)
    stream = keys.intake("normal", "short")
    (entry,) = await intake.read(redis, keys, "dead-1", [stream], count=1, block_ms=None)
    # Two more workers took it over and died too: three deliveries so far.
    for consumer in ("dead-2", "dead-3"):
        await redis.xclaim(stream, WORKER_GROUP, consumer, min_idle_time=0, message_ids=[entry.entry_id])

    async with running_workers([fast_reclaim(redis_url, keys)], engine, redis_url):
        events = [event async for event in reply.events()]
        # The error is written first, then the entry moves to the dead-letter stream.
        deadline = time.monotonic() + 5
        while (await redis.xpending(stream, WORKER_GROUP))["pending"]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
    reply.close()
    assert [(event.type, event.error_code) for event in events] == [("error", "max_deliveries")]
    (dead,) = await redis.xrange(keys.dead_letter)
    assert dead[1][b"reason"] == b"max_deliveries"
    assert (await redis.xpending(stream, WORKER_GROUP))["pending"] == 0


def streamed_text(events: list[Any]) -> str:
    return "".join(
        event["choices"][0].get("text", "") for event in events if isinstance(event, dict) and event.get("choices")
    )


async def test_a_sigkilled_worker_process_mid_stream_leaves_the_client_an_uninterrupted_greedy_answer(
    redis_url: str, tiny_model: Path, engine: VllmEngine, tmp_path: Path
) -> None:
    """A real worker process (its own vLLM engine) is SIGKILLed while it streams a realtime reply,
    after the request's deadline passed; a second worker, with the default heartbeat and take-over
    settings, sees the death from the heartbeat and takes the request over. The client's stream goes
    on within seconds: the same token ids and text as an uninterrupted greedy run, each position
    once, never a deadline error. The killed worker's vLLM processes die with it."""
    body = {
        "model": "tiny",
        "prompt": list(range(10, 42)),
        "max_tokens": 1000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "tier": "realtime",
    }
    # A realtime deadline far shorter than the reply: the take-over comes after it has passed.
    async with running_stack(redis_url, tiny_model, None, realtime_deadline_s=0.5) as stack:
        survivor = WorkerSettings(
            redis_url=redis_url, key_prefix=stack.keys.prefix, model=str(tiny_model), worker_id="survivor"
        )
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            # The uninterrupted reference, served by the survivor alone.
            async with running_workers([survivor], engine, redis_url):
                reference = await stream_events(client, "/v1/completions", body)
            doomed, _log = await start_worker_process(redis_url, stack.keys, tiny_model, "doomed", tmp_path)
            try:
                await wait_for_worker(stack.redis, stack.keys, "doomed", doomed, timeout_s=180)
                engine_processes = descendants(doomed.pid)
                events: list[Any] = []
                killed_at: float | None = None
                chunks_when_killed = 0
                resumed_after_s: float | None = None
                async with contextlib.AsyncExitStack() as takeover:
                    sent = time.monotonic()
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        assert response.status_code == 200
                        async for line in sse_lines(response):
                            if not line.startswith("data: "):
                                continue
                            payload = line.removeprefix("data: ")
                            events.append(DONE if payload == DONE else orjson.loads(payload))
                            now = time.monotonic()
                            if killed_at is not None and resumed_after_s is None:
                                resumed_after_s = now - killed_at
                            if killed_at is None and now - sent > 1.0:
                                doomed.kill()  # SIGKILL: no drain, no goodbye; its entry stays pending
                                await doomed.wait()
                                killed_at, chunks_when_killed = time.monotonic(), len(events)
                                # Only now a second worker exists to take the request over.
                                await takeover.enter_async_context(running_workers([survivor], engine, redis_url))
                left = await still_running(engine_processes, timeout_s=5)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(doomed.pid, signal.SIGKILL)  # whatever the test itself must not leave behind
                await doomed.wait()
    print(f"\nkill → next token: {resumed_after_s} s ({chunks_when_killed} chunks before the kill)")
    assert 0 < chunks_when_killed < 900, "the worker was not killed mid-stream"
    assert engine_processes, "the worker had no engine processes to check"
    assert not left, f"the SIGKILLed worker's engine processes outlived it: {left}"
    assert resumed_after_s is not None and resumed_after_s < 4.0, f"take-over took {resumed_after_s} s"
    assert len(streamed_token_ids(reference)) == 1000
    assert streamed_token_ids(events) == streamed_token_ids(reference)
    assert streamed_text(events) == streamed_text(reference)
    assert events[-1] == DONE and finish_reasons(events) == ["length"]


async def test_a_paused_worker_that_comes_back_is_fenced_off_and_writes_nothing(
    redis_url: str, tiny_model: Path, engine: VllmEngine, tmp_path: Path
) -> None:
    """A real worker process is paused (SIGSTOP) mid-stream long enough to look dead; a second worker
    takes the request over. When the paused one resumes (SIGCONT) with its engine's output piled up,
    the fence refuses every write it tries: the client's stream still equals an uninterrupted greedy
    run, each position once, and the paused worker lets the request go and keeps serving."""
    body = {
        "model": "tiny",
        "prompt": list(range(50, 80)),
        "max_tokens": 600,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    async with running_stack(redis_url, tiny_model, None) as stack:
        survivor = WorkerSettings(
            redis_url=redis_url, key_prefix=stack.keys.prefix, model=str(tiny_model), worker_id="survivor"
        )
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            async with running_workers([survivor], engine, redis_url):
                reference = await stream_events(client, "/v1/completions", body)
            paused, log = await start_worker_process(redis_url, stack.keys, tiny_model, "paused", tmp_path)
            try:
                await wait_for_worker(stack.redis, stack.keys, "paused", paused, timeout_s=180)
                events: list[Any] = []
                async with contextlib.AsyncExitStack() as takeover:
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        async for line in sse_lines(response):
                            if not line.startswith("data: "):
                                continue
                            payload = line.removeprefix("data: ")
                            events.append(DONE if payload == DONE else orjson.loads(payload))
                            if len(events) == 30:
                                paused.send_signal(signal.SIGSTOP)
                                await takeover.enter_async_context(running_workers([survivor], engine, redis_url))
                                # Long enough to be taken for dead and taken over, then it wakes up.
                                await asyncio.sleep(4)
                                paused.send_signal(signal.SIGCONT)
                # Back and well: it beats again and nothing of this request is left pending anywhere.
                await asyncio.sleep(2)
                alive = paused.returncode is None and await stack.redis.zscore(stack.keys.workers, "paused")
                pending = [await stack.redis.xpending(stream, "workers") for stream in stack.keys.intake_all()]
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(paused.pid, signal.SIGKILL)
                await paused.wait()
    assert streamed_token_ids(events) == streamed_token_ids(reference)
    assert streamed_text(events) == streamed_text(reference)
    assert events[-1] == DONE and finish_reasons(events) == ["length"]
    assert alive, "the paused worker did not come back"
    assert all(entry["pending"] == 0 for entry in pending)
    # It learned that it lost the request from the fence (a refused write, or a refused claim refresh,
    # whichever came first after SIGCONT) and let it go; tests/integration shows the refused write.
    assert "request_fenced" in log.read_text(), "the paused worker was not fenced off"


async def start_worker_process(
    redis_url: str, keys: Keys, model: Path, worker_id: str, folder: Path
) -> tuple[asyncio.subprocess.Process, Path]:
    """A ``tailcut worker`` process with its own engine (default heartbeat and take-over settings),
    in a process group of its own; its log goes to ``folder``."""
    env = {
        **os.environ,
        "TAILCUT_REDIS_URL": redis_url,
        "TAILCUT_KEY_PREFIX": keys.prefix,
        "TAILCUT_MODEL": str(model),
        "TAILCUT_MAX_MODEL_LEN": str(TEST_MAX_MODEL_LEN),
        "TAILCUT_WORKER_ID": worker_id,
        "TAILCUT_ENGINE__KV_CACHE_MEMORY_BYTES": str(TEST_KV_CACHE_BYTES),
        "TAILCUT_ENGINE__MAX_NUM_SEQS": "8",
        "TAILCUT_METRICS_PORT": "0",
        # Compared with greedy references: no summary fallback (see tests.stack.running_workers).
        "TAILCUT_DEGRADE__REALTIME_HEARTBEAT_MS": "0",
        "TAILCUT_DEGRADE__NORMAL_HEARTBEAT_MS": "0",
    }
    log = folder / f"{worker_id}.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tailcut", "worker", env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return process, log


async def still_running(processes: dict[int, tuple[int, int, str]], *, timeout_s: float) -> list[str]:
    """Those of ``processes`` still alive (neither gone nor a zombie) after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [f"{pid} {row[2]}" for pid, row in processes.items() if pid in live_processes()]
        if not alive or time.monotonic() > deadline:
            return alive
        await asyncio.sleep(0.1)


async def wait_for_worker(
    redis: aioredis.Redis, keys: Keys, worker_id: str, process: asyncio.subprocess.Process, *, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while await redis.zscore(keys.workers, worker_id) is None:
        assert process.returncode is None, f"the worker process exited with status {process.returncode} during start"
        assert time.monotonic() < deadline, f"the worker process was not serving after {timeout_s:.0f} s"
        await asyncio.sleep(0.2)


async def test_a_worker_restarted_under_the_same_id_resumes_what_its_former_process_left_pending(
    redis_url: str, engine: VllmEngine, setup: tuple[aioredis.Redis, Keys, ReplyRouter]
) -> None:
    """A stable worker id (a pod that restarts under its name): the new process is alive under the
    name the dead one held its entries with, so no one would see a death; it takes them back at start
    (not after the idle reclaim time, 15 s by default) and resumes from the output already written."""
    redis, keys, router = setup
    prompt_ids = list(range(12, 44))
    expected = await reference_ids(engine, prompt_ids, 40, "reference-same-id")
    message = message_for(prompt_ids, 40)
    reply = router.open(message.id)
    await intake.enqueue(redis, keys, message)
    (entry,) = await intake.read(redis, keys, "pod-0", [keys.intake("normal", "short")], count=1, block_ms=None)
    writer = OutputWriter(redis, keys, ttl_s=60)
    writer.start()
    writer.emit(API_ID, OutputEvent(rid=message.id, seq=1, type="chunk", token_ids=expected[:7]))
    await writer.close()

    restarted = WorkerSettings(redis_url=redis_url, key_prefix=keys.prefix, worker_id="pod-0", read_block_ms=100)
    async with running_workers([restarted], engine, redis_url):
        async with asyncio.timeout(5):
            events = [event async for event in reply.events()]
    reply.close()
    assert [token for event in events for token in event.token_ids] == expected
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    assert (await redis.xpending(entry.stream, WORKER_GROUP))["pending"] == 0
