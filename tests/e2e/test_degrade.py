"""Degrade, never stall, on the real engine: a request whose output stops for longer than its tier's
heartbeat limit finishes with a summary the engine writes, marked degraded — not a truncation, not
an error."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from bench.sse import sse_lines
from queues import intake
from queues.messages import OutputEvent, RequestMessage, SamplingSpec
from queues.output import read_output
from tests.e2e.test_streaming import reference_ids
from tests.procs import descendants
from tests.sse import DONE, streamed_token_ids
from tests.stack import running_stack
from workers.engines.vllm_engine import VllmEngine
from workers.prompter import Prompter

pytestmark = pytest.mark.engine

PAUSE_S = 1.5
SUMMARY_MAX_TOKENS = 24


def engine_core_pid() -> int:
    """The shared test engine's EngineCore process: a child of this test process (not the engine of a
    process some other test started and that is still going away)."""
    me = os.getpid()
    cores = [pid for pid, row in descendants(me).items() if "EngineCore" in row[2] and row[0] == me]
    assert len(cores) == 1, f"expected one engine core below the test process, found {cores}"
    return cores[0]


async def pause_engine(after: asyncio.Event) -> None:
    """SIGSTOP the engine process once ``after`` is set, for longer than the heartbeat limit."""
    await after.wait()
    core = engine_core_pid()
    os.kill(core, signal.SIGSTOP)
    try:
        await asyncio.sleep(PAUSE_S)
    finally:
        os.kill(core, signal.SIGCONT)


async def test_a_request_whose_engine_stalls_mid_stream_ends_in_a_summary_marked_degraded(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    body = {
        "model": "tiny",
        "prompt": list(range(200, 240)),
        "max_tokens": 600,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "tier": "realtime",
    }
    worker = {"degrade": {"realtime_heartbeat_ms": 500, "summary_max_tokens": SUMMARY_MAX_TOKENS}}
    async with running_stack(redis_url, tiny_model, engine, worker=worker, prompter=Prompter.load(tiny_model)) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            events: list[Any] = []
            twenty = asyncio.Event()
            pauser = asyncio.create_task(pause_engine(twenty))
            async with client.stream("POST", "/v1/completions", json=body) as response:
                request_id = response.headers["x-tailcut-request-id"]
                async for line in sse_lines(response):
                    if line.startswith("data: "):
                        payload = line.removeprefix("data: ")
                        events.append(DONE if payload == DONE else orjson.loads(payload))
                        if len(events) == 20:
                            twenty.set()
            await pauser
            stored = await read_output(stack.redis, stack.keys, request_id, from_seq=1)
            logged = await stack.redis.xrange(stack.keys.events)
            metrics = (await client.get("/metrics")).text
    # Undisturbed greedy output of the engine itself, outside tailcut (no watchdog to degrade it).
    reference = await reference_ids(engine, body["prompt"], 600, "degrade-reference")
    chunks = [event for event in events if isinstance(event, dict)]
    notices = [
        index for index, chunk in enumerate(chunks) if "tailcut" in chunk and not chunk["choices"][0]["finish_reason"]
    ]
    assert len(notices) == 1, "one degraded notice in the stream"
    notice = chunks[notices[0]]["tailcut"]
    assert notice["degraded"] == "summary" and notice["reason"] == "heartbeat" and notice["gap_ms"] > 500
    before = streamed_token_ids(chunks[: notices[0]])
    summary = streamed_token_ids(chunks[notices[0] + 1 :])
    assert 20 <= len(before) < 600 and before == reference[: len(before)], "full decoding up to the stall"
    assert 0 < len(summary) <= SUMMARY_MAX_TOKENS, "the rest is the engine's summary, bounded"
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] in ("stop", "length") and final["tailcut"] == notice
    assert events[-1] == DONE and not any("error" in chunk for chunk in chunks)
    assert [event.type for event in stored].count("degraded") == 1 and stored[-1].type == "final"
    assert stored[-1].completion_tokens == len(before) + len(summary)
    assert any(fields[b"type"] == b"degraded" and fields[b"rid"].decode() == request_id for _id, fields in logged)
    assert 'tailcut_requests_degraded_total{reason="heartbeat",tier="realtime"} 1.0' in metrics


async def test_a_continuation_waiting_too_long_to_resume_is_answered_with_its_summary(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    """A continuation (a request that already streamed 30 tokens, then yielded) waits in a worker
    whose only slot is busy; its wait since its last output passes the limit, and it is answered at
    once with its summary instead of waiting for the slot."""
    busy = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1900, "ignore_eos": True, "tier": "normal"}
    worker = {"max_running": 1, "degrade": {"normal_heartbeat_ms": 500, "summary_max_tokens": SUMMARY_MAX_TOKENS}}
    async with running_stack(redis_url, tiny_model, engine, worker=worker, prompter=Prompter.load(tiny_model)) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            blocker = asyncio.create_task(client.post("/v1/completions", json=busy))
            while not stack.workers[0].running_ids:
                await asyncio.sleep(0.02)
            now_ms = int(time.time() * 1000)
            waiting = RequestMessage(
                id=uuid.uuid4().hex,
                tenant="t",
                tier="normal",
                bucket="medium",
                prompt_token_ids=list(range(300, 330)),
                sampling=SamplingSpec(max_tokens=400, temperature=0.0, ignore_eos=True),
                predicted_output_tokens=400,
                enqueued_at_ms=now_ms - 3000,
                deadline_ms=now_ms + 60_000,
                reply_to="nobody-listens",
                generated_token_ids=list(range(400, 430)),
                next_seq=31,
                slice_index=1,
                last_output_ms=now_ms - 2000,
            )
            await intake.enqueue(stack.redis, stack.keys, waiting)
            stored: list[OutputEvent] = []
            for _ in range(300):
                stored = await read_output(stack.redis, stack.keys, waiting.id, from_seq=1)
                if stored and stored[-1].terminal:
                    break
                await asyncio.sleep(0.05)
            still_busy = not blocker.done()
            blocker.cancel()
    assert still_busy, "the slot was busy all along: the summary did not wait for it"
    assert stored[0].type == "degraded" and stored[0].seq == 31
    assert stored[0].degraded is not None and int(stored[0].degraded["gap_ms"]) >= 2000
    summary = [token for event in stored if event.type == "chunk" for token in event.token_ids]
    assert 0 < len(summary) <= SUMMARY_MAX_TOKENS
    assert stored[-1].type == "final" and stored[-1].degraded == stored[0].degraded
    assert stored[-1].completion_tokens == 30 + len(summary)


async def test_while_the_realtime_breaker_is_open_replies_are_capped_and_background_waits(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    """Tier 0 open (three slow realtime requests, made here with synthetic latencies): a long realtime
    reply is capped and marked, a background request waits until the breaker closes, and /readyz and
    /metrics say so."""
    cap = 12
    worker = {"breakers": {"realtime_cap_tokens": cap, "realtime_open_s": 60}}
    realtime = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 200, "ignore_eos": True, "tier": "realtime"}
    background = {**realtime, "max_tokens": 5, "tier": "background"}
    async with running_stack(redis_url, tiny_model, engine, worker=worker) as stack:
        breakers = stack.workers[0].breakers
        for n in range(3):
            await breakers.record(
                "realtime", ttft_ms=10, e2e_ms=2_000, request_id=f"slow{n}", now_ms=int(time.time() * 1000)
            )
        await asyncio.sleep(1.5)  # the worker reads the breakers every second
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            capped = await client.post("/v1/completions", json=realtime)
            waiting = asyncio.create_task(client.post("/v1/completions", json=background))
            await asyncio.sleep(1.0)
            waited = not waiting.done()
            ready = (await client.get("/readyz")).json()
            metrics = (await client.get("/metrics")).text
            await stack.redis.hset(stack.keys.breaker("realtime"), mapping={"state": "closed", "reason": "test"})
            served = await asyncio.wait_for(waiting, timeout=10)
    body = capped.json()
    assert capped.status_code == 200 and body["usage"]["completion_tokens"] == cap
    assert body["tailcut"] == {"degraded": "capped", "reason": "breaker", "max_tokens": cap}
    assert waited, "background was admitted while the breaker was open"
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 5
    assert ready["breakers"]["realtime"]["state"] == "open"
    assert 'tailcut_breaker_state{tier="realtime"} 2.0' in metrics
