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

from queues import intake
from queues.keys import WORKER_GROUP, Keys
from queues.messages import OutputEvent, RequestMessage, SamplingSpec
from queues.output import OutputWriter
from queues.replies import ReplyRouter
from tests.conftest import TEST_KV_CACHE_BYTES, TEST_MAX_MODEL_LEN
from tests.e2e.conftest import API_ID
from tests.e2e.test_streaming import reference_ids
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
    """A real worker process (its own vLLM engine) is SIGKILLed while it streams; a second worker takes
    the request over and the client's stream goes on: the same token ids and the same text as an
    uninterrupted greedy run of the same request, each position once."""
    body = {
        "model": "tiny",
        "prompt": list(range(10, 42)),
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    async with running_stack(redis_url, tiny_model, None) as stack:
        survivor = WorkerSettings(
            redis_url=redis_url,
            key_prefix=stack.keys.prefix,
            model=str(tiny_model),
            worker_id="survivor",
            read_block_ms=100,
            heartbeat_s=0.05,
            reclaim_after_ms=500,
            reclaim_interval_s=0.1,
        )
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            # The uninterrupted reference, served by the survivor alone.
            async with running_workers([survivor], engine, redis_url):
                reference = await stream_events(client, "/v1/completions", body)
            env = {
                **os.environ,
                "TAILCUT_REDIS_URL": redis_url,
                "TAILCUT_KEY_PREFIX": stack.keys.prefix,
                "TAILCUT_MODEL": str(tiny_model),
                "TAILCUT_MAX_MODEL_LEN": str(TEST_MAX_MODEL_LEN),
                "TAILCUT_WORKER_ID": "doomed",
                "TAILCUT_HEARTBEAT_S": "0.1",
                "TAILCUT_ENGINE__KV_CACHE_MEMORY_BYTES": str(TEST_KV_CACHE_BYTES),
                "TAILCUT_ENGINE__MAX_NUM_SEQS": "8",
            }
            log = (tmp_path / "doomed.log").open("wb")
            command = [sys.executable, "-m", "tailcut", "worker"]
            doomed = await asyncio.create_subprocess_exec(
                *command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                await wait_for_worker(stack.redis, stack.keys, "doomed", doomed, timeout_s=180)
                events: list[Any] = []
                chunks_when_killed = 0
                async with contextlib.AsyncExitStack() as takeover:
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        assert response.status_code == 200
                        async for line in response.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            payload = line.removeprefix("data: ")
                            events.append(DONE if payload == DONE else orjson.loads(payload))
                            if len(events) == 40 and doomed.returncode is None:
                                doomed.kill()  # SIGKILL: no drain, no goodbye; its entry stays pending
                                await doomed.wait()
                                chunks_when_killed = len(events)
                                # Only now a second worker exists to take the request over.
                                await takeover.enter_async_context(running_workers([survivor], engine, redis_url))
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(doomed.pid, signal.SIGKILL)  # its engine-core process too
                await doomed.wait()
                log.close()
    assert chunks_when_killed == 40, "the worker was not killed mid-stream"
    assert len(streamed_token_ids(reference)) == 400
    assert streamed_token_ids(events) == streamed_token_ids(reference)
    assert streamed_text(events) == streamed_text(reference)
    assert events[-1] == DONE and finish_reasons(events) == ["length"]


async def wait_for_worker(
    redis: aioredis.Redis, keys: Keys, worker_id: str, process: asyncio.subprocess.Process, *, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while await redis.zscore(keys.workers, worker_id) is None:
        assert process.returncode is None, f"the worker process exited with status {process.returncode} during start"
        assert time.monotonic() < deadline, f"the worker process was not serving after {timeout_s:.0f} s"
        await asyncio.sleep(0.2)
