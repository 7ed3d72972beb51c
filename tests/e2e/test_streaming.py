"""The whole path with the real vLLM engine on CPU: HTTP → Redis → worker → engine → Redis → HTTP."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from admission.tokenizer import PromptTokenizer
from bench.sse import sse_lines
from queues.messages import SamplingSpec
from queues.output import read_output
from tests.sse import (
    DONE,
    assert_only_pings,
    finish_reasons,
    positions_grow,
    read_for,
    stream_events,
    streamed_token_ids,
)
from tests.stack import running_stack
from workers.engines.vllm_engine import VllmEngine

pytestmark = pytest.mark.engine


async def reference_ids(engine: VllmEngine, prompt_ids: list[int], max_tokens: int, request_id: str) -> list[int]:
    """Greedy output of the engine itself for the same prompt, outside tailcut."""
    ids: list[int] = []
    spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for delta in engine.generate(request_id, prompt_ids, spec, priority=0):
        ids += delta.token_ids
    return ids


async def test_sixteen_concurrent_streams_each_get_every_token_once_in_order(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    tokenizer = PromptTokenizer(tiny_model, num_threads=2)
    prompts = [f"question {index}: what is the tail latency of queue {index}?" for index in range(16)]
    max_tokens = [24 + 2 * index for index in range(16)]
    async with running_stack(redis_url, tiny_model, engine) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            bodies = [
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": limit,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "return_token_ids": True,
                    "stream_options": {"include_usage": True},
                }
                for prompt, limit in zip(prompts, max_tokens, strict=True)
            ]
            streams = await asyncio.gather(*(stream_events(client, "/v1/chat/completions", body) for body in bodies))
    for index, (prompt, limit, events) in enumerate(zip(prompts, max_tokens, streams, strict=True)):
        prompt_ids = await tokenizer.encode_chat([{"role": "user", "content": prompt}])
        expected = await reference_ids(engine, prompt_ids, limit, f"reference-{index}")
        assert streamed_token_ids(events) == expected
        assert finish_reasons(events) == ["length"]
        assert events[-1] == DONE and events.count(DONE) == 1
        usage = events[-2]["usage"]
        assert usage == {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": limit,
            "total_tokens": len(prompt_ids) + limit,
        }
        text = "".join(event["choices"][0]["delta"].get("content", "") for event in events[:-2])
        assert text == tokenizer._tokenizer.decode(expected)
    tokenizer.close()


async def test_official_openai_client_streams_from_tailcut(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    async with running_stack(redis_url, tiny_model, engine) as stack:
        client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "tier": "realtime"},
        )
        chunks = [chunk async for chunk in stream]
        completion = await client.completions.create(
            model="tiny", prompt="the queue", max_tokens=7, extra_body={"ignore_eos": True}
        )
        models = await client.models.list()
        await client.close()
    content = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert len(content) >= 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 7
    assert completion.choices[0].finish_reason == "length"
    assert [model.id for model in models.data] == ["tiny"]


async def test_a_chat_streams_role_chunk_leaves_with_the_first_token_not_at_acceptance(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    """vLLM's server sends a chat stream's role-only chunk with the first token, and ``vllm bench serve``
    times TTFT from the first chunk with ``choices``: sent at acceptance, it made a queued request's TTFT
    read as the API's few milliseconds. Queued with no worker, a chat stream gets its headers and no chunk,
    only an SSE comment now and then (``TAILCUT_SSE_PING_S``: proxies cut idle streams); served, its first
    write is the role chunk and the first token's together."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True}
    async with running_stack(redis_url, tiny_model, None, sse_ping_s=0.4, reply_poll_max_s=0.5) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            async with client.stream("POST", "/v1/chat/completions", json=chat) as response:
                assert response.status_code == 200 and response.headers["x-tailcut-request-id"]
                waited = await read_for(response, 4.0)
    assert_only_pings(waited)
    async with running_stack(redis_url, tiny_model, engine) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            async with client.stream("POST", "/v1/chat/completions", json=chat) as response:
                first = await anext(response.aiter_raw())
    frames = [line for line in first.split(b"\n") if line.startswith(b"data: ")]
    assert len(frames) >= 2, first
    assert b'"delta":{"role":"assistant","content":""}' in frames[0], frames[0]
    assert b'"delta":{"content":' in frames[1], frames[1]


async def test_client_disconnect_aborts_the_engine_request_within_one_second(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "write forever"}],
        "max_tokens": 1900,
        "ignore_eos": True,
        "stream": True,
    }
    async with running_stack(redis_url, tiny_model, engine) as stack:
        worker = stack.workers[0]
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                request_id = response.headers["x-tailcut-request-id"]
                lines = 0
                async for line in sse_lines(response):
                    lines += line.startswith("data: ")
                    if lines == 5:
                        break
                assert engine.num_unfinished() == 1
            left_at = time.monotonic()
        while engine.num_unfinished() or worker.running_ids:
            assert time.monotonic() - left_at < 1.0, "the engine request was not aborted within 1 s"
            await asyncio.sleep(0.01)
        events = await read_output(stack.redis, stack.keys, request_id, from_seq=1)
    terminal = [event for event in events if event.terminal]
    assert [(event.type, event.error_code) for event in terminal] == [("error", "cancelled")]
    generated = sum(len(event.token_ids) for event in events)
    assert generated < 1900


async def test_two_workers_in_one_group_serve_32_requests_once_each(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    async def one(client: httpx.AsyncClient, index: int) -> dict[str, Any]:
        response = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": f"job {index}", "max_tokens": 8, "ignore_eos": True},
        )
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    async with running_stack(redis_url, tiny_model, engine, num_workers=2) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            bodies = await asyncio.gather(*(one(client, index) for index in range(32)))
        # A response leaves as soon as the final event is in Redis; the XACK follows right after.
        while sum(len(worker.served_ids) for worker in stack.workers) < 32:
            await asyncio.sleep(0.01)
        served = Counter(request_id for worker in stack.workers for request_id in worker.served_ids)
        pending = [await stack.redis.xpending(stream, "workers") for stream in stack.keys.intake_all()]
    request_ids = Counter(body["id"].removeprefix("cmpl-") for body in bodies)
    assert len(request_ids) == 32 and set(request_ids.values()) == {1}
    assert all(body["usage"]["completion_tokens"] == 8 for body in bodies)
    # Counted, not collected in sets: a request served twice (by one worker or by both) shows as a 2.
    assert served == request_ids, "every request served exactly once, by one of the workers"
    assert all(entry["pending"] == 0 for entry in pending)


async def test_non_streaming_chat_returns_one_body_with_usage(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    async with running_stack(redis_url, tiny_model, engine) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            response = await client.post(
                "/v1/chat/completions",
                headers={"X-Tailcut-Tier": "background"},
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True},
            )
            metrics = (await client.get("/metrics")).text
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    # Predicted min(5, prior 1024) = 5 tokens, got 5: one observation of error 0.
    assert 'tailcut_prediction_error_tokens_count{tier="background"} 1.0' in metrics
    assert 'tailcut_prediction_error_tokens_bucket{le="1.0",tier="background"} 1.0' in metrics
    assert 'tailcut_requests_admitted_total{bucket="short",tier="background"} 1.0' in metrics


async def test_vllm_bench_serves_own_request_functions_read_every_token_from_tailcut(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    """``vllm bench serve``'s request functions (the installed vLLM's own code, which splits SSE on
    blank lines and parses each message as ``data: <json>``) read tailcut's streams as they read vLLM's
    server: every request succeeds, with the text and the token count the engine produces. A stream
    carries SSE ids only when its client asks (``X-Tailcut-Event-Ids``) or can resume it."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_chat_completions,
        async_request_openai_completions,
    )

    tokenizer = PromptTokenizer(tiny_model, num_threads=2)
    prompt = "the queue is long because"
    chat = [{"role": "user", "content": prompt}]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stream": True}
    async with running_stack(redis_url, tiny_model, engine) as stack:
        async with aiohttp.ClientSession() as session:
            outputs = [
                await call(
                    RequestFuncInput(
                        prompt=prompt,
                        api_url=f"{stack.base_url}{path}",
                        prompt_len=0,
                        output_len=24,
                        model="tiny",
                        ignore_eos=True,
                        extra_body={"temperature": 0},
                    ),
                    session,
                )
                for call, path in (
                    (async_request_openai_completions, "/v1/completions"),
                    (async_request_openai_chat_completions, "/v1/chat/completions"),
                )
            ]
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            plain = (await client.post("/v1/completions", json=body)).text
            asked = (await client.post("/v1/completions", json=body, headers={"X-Tailcut-Event-Ids": "true"})).text
            resumable = (await client.post("/v1/completions", json=body, headers={"Idempotency-Key": "ids-1"})).text
            refused = await client.post("/v1/completions", json=body, headers={"X-Tailcut-Event-Ids": "sometimes"})
    completion_ids = await tokenizer.encode_text(prompt)
    chat_ids = await tokenizer.encode_chat(chat)
    for output, prompt_ids in zip(outputs, (completion_ids, chat_ids), strict=True):
        assert output.success, output.error
        assert output.output_tokens == 24 and output.prompt_len == len(prompt_ids)
        expected = await reference_ids(engine, prompt_ids, 24, f"reference-vllm-bench-{len(prompt_ids)}")
        assert output.generated_text == tokenizer._tokenizer.decode(expected)
        assert output.ttft > 0 and len(output.itl) >= 1
    tokenizer.close()

    def ids(text: str) -> list[int]:
        return [int(line.removeprefix("id: ")) for line in text.splitlines() if line.startswith("id: ")]

    assert ids(plain) == [] and plain.endswith("data: [DONE]\n\n") and plain.count("data: ") >= 3
    # Each frame's id is the last position it carries: they only grow.
    assert len(ids(asked)) >= 2 and positions_grow(ids(asked))
    assert len(ids(resumable)) >= 2 and positions_grow(ids(resumable))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-Tailcut-Event-Ids"
