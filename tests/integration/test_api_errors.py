"""Bad input gets a clear OpenAI-shaped error and the right status; a dead Redis gets a fast 503."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TEST_MAX_MODEL_LEN
from tests.stack import private_redis_server, running_stack

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]

CASES: list[tuple[str, str, dict[str, Any] | bytes, dict[str, str], int, str, str | None]] = [
    # (name, path, body, headers, status, words in the message, param)
    ("malformed json", CHAT, b'{"messages": [', {}, 400, "not valid JSON", None),
    ("wrong type", CHAT, {"messages": HELLO, "max_tokens": "lots"}, {}, 400, "valid integer", "max_tokens"),
    ("missing messages", CHAT, {"model": "tiny"}, {}, 400, "missing required field `messages`", "messages"),
    ("empty messages", CHAT, {"messages": []}, {}, 400, "at least 1 item", "messages"),
    ("unknown role", CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, {}, 400, "'system'", "messages.0.role"),
    (
        "max_tokens zero",
        CHAT,
        {"messages": HELLO, "max_tokens": 0},
        {},
        400,
        "greater than or equal to 1",
        "max_tokens",
    ),
    ("unknown tier", CHAT, {"messages": HELLO, "tier": "urgent"}, {}, 400, "unknown tier 'urgent'", "tier"),
    ("unknown tier header", CHAT, {"messages": HELLO}, {"X-Tailcut-Tier": "vip"}, 400, "X-Tailcut-Tier", "tier"),
    (
        "over context",
        CHAT,
        {"messages": HELLO, "max_tokens": TEST_MAX_MODEL_LEN},
        {},
        400,
        "maximum context length",
        "max_tokens",
    ),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": HELLO}, {}, 404, "'gpt-9' does not exist", "model"),
    ("n above one", CHAT, {"messages": HELLO, "n": 2}, {}, 400, "n > 1", "n"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, {}, 400, "`prompt` is empty", "prompt"),
    ("token out of vocab", "/v1/completions", {"prompt": [1, 999999]}, {}, 400, "outside the vocabulary", "prompt"),
    ("many prompts", "/v1/completions", {"prompt": ["a", "b"]}, {}, 400, "one prompt per request", "prompt"),
    ("no such route", "/v1/embeddings", {"input": "x"}, {}, 404, "Not Found", None),
    ("no body", CHAT, b"", {}, 400, "needs a JSON body", None),
    ("too many stops", CHAT, {"messages": HELLO, "stop": ["x"] * 17}, {}, 400, "at most 16 items", "stop"),
    ("long stop", CHAT, {"messages": HELLO, "stop": "x" * 1001}, {}, 400, "at most 1000 characters", "stop"),
    ("many stop ids", CHAT, {"messages": HELLO, "stop_token_ids": [1] * 65}, {}, 400, "at most 64", "stop_token_ids"),
    ("too many messages", CHAT, {"messages": HELLO * 2049}, {}, 400, "at most 2048 items", "messages"),
    ("body not an object", CHAT, b"[1, 2]", {}, 400, "must be a JSON object", None),
    # What tailcut does not do is refused, not ignored: the reply would look like an answer to what was sent.
    ("best of two", "/v1/completions", {"prompt": "hi", "best_of": 2}, {}, 400, "one completion", "best_of"),
    ("beam search", CHAT, {"messages": HELLO, "use_beam_search": True}, {}, 400, "beam search", "use_beam_search"),
    ("logit bias", CHAT, {"messages": HELLO, "logit_bias": {"50256": -100}}, {}, 400, "logit_bias", "logit_bias"),
    (
        "json mode",
        CHAT,
        {"messages": HELLO, "response_format": {"type": "json_object"}},
        {},
        400,
        "'json_object' is not supported",
        "response_format",
    ),
    ("vLLM guided json", "/v1/completions", {"prompt": "hi", "guided_json": {}}, {}, 400, "constrain", "guided_json"),
    (
        "prompt logprobs",
        "/v1/completions",
        {"prompt": "hi", "prompt_logprobs": 1},
        {},
        400,
        "prompt logp",
        "prompt_logprobs",
    ),
    ("tools", CHAT, {"messages": HELLO, "tools": [{"type": "function"}]}, {}, 400, "tool calling", "tools"),
    ("tool required", CHAT, {"messages": HELLO, "tool_choice": "required"}, {}, 400, "tool calling", "tool_choice"),
    ("functions", CHAT, {"messages": HELLO, "functions": [{"name": "f"}]}, {}, 400, "tool calling", "functions"),
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def test_every_bad_input_gets_its_status_and_a_message_that_says_what_to_fix(
    redis_url: str, tiny_model: Path
) -> None:
    async with running_stack(redis_url, tiny_model, None, max_model_len=TEST_MAX_MODEL_LEN) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            for name, path, body, headers, status, words, param in CASES:
                if isinstance(body, bytes):
                    response = await client.post(path, content=body, headers={"content-type": "application/json"})
                else:
                    response = await client.post(path, json=body, headers=headers)
                assert response.status_code == status, (name, response.text)
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, name
                assert words in error["message"], (name, error["message"])
                assert error["param"] == param, (name, error)
        # Nothing above was enqueued: every refusal happened before the XADD.
        assert all([await stack.redis.xlen(stream) == 0 for stream in stack.keys.intake_all()])


async def test_the_values_of_unsupported_fields_that_mean_none_are_accepted(redis_url: str, tiny_model: Path) -> None:
    """Clients that send the "none" value of a field tailcut refuses (an empty tool list, no tool choice,
    plain text) are served: streamed, so acceptance answers at once with no worker running."""
    nones: list[tuple[str, dict[str, Any]]] = [
        (CHAT, {"tools": [], "tool_choice": "none", "functions": None, "function_call": "auto"}),
        (CHAT, {"response_format": {"type": "text"}, "logit_bias": {}, "best_of": 1, "use_beam_search": False}),
        ("/v1/completions", {"guided_json": None, "structured_outputs": None, "prompt_logprobs": None}),
    ]
    async with running_stack(redis_url, tiny_model, None) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            for path, fields in nones:
                body = {"messages": HELLO} if path == CHAT else {"prompt": "hello"}
                async with client.stream("POST", path, json={**body, **fields, "stream": True}) as response:
                    if response.status_code != 200:
                        await response.aread()
                    assert response.status_code == 200, (fields, response.text)


async def test_redis_down_gives_503_within_one_second(tiny_model: Path, free_port: int) -> None:
    with private_redis_server(free_port) as server:
        async with running_stack(server.url, tiny_model, None) as stack:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
                server.kill()
                for path in (CHAT, "/v1/completions"):
                    body = {"messages": HELLO} if path == CHAT else {"prompt": "hello"}
                    started = time.monotonic()
                    response = await client.post(path, json=body)
                    elapsed_s = time.monotonic() - started
                    assert response.status_code == 503, response.text
                    assert response.json()["error"]["code"] == "service_unavailable"
                    assert elapsed_s < 1.0
                ready = await client.get("/readyz")
                assert ready.status_code == 503
                assert ready.json()["ready"] is False


async def test_a_full_tier_queue_sheds_new_requests_with_429_background_first(redis_url: str, tiny_model: Path) -> None:
    # No workers: everything accepted stays queued. Background is bounded at 3, realtime at 50.
    limits = {"shed_background_waiting": 3, "shed_realtime_waiting": 50, "shed_probe_interval_s": 0.05}
    async with running_stack(redis_url, tiny_model, None, **limits) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:

            async def send(tier: str) -> httpx.Response:
                """Streamed, so an accepted request answers at once (200, its id) while it waits in
                the queue; a hung API fails the test with a timeout."""
                body = {"prompt": [5, 6, 7], "max_tokens": 4, "tier": tier, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body, timeout=2) as response:
                    if response.status_code != 200:
                        await response.aread()
                    return response

            responses = [await send("background") for _ in range(6)]
            assert [response.status_code for response in responses] == [200, 200, 200, 429, 429, 429]
            assert all("x-tailcut-request-id" in response.headers for response in responses[:3])
            refused = await send("background")
            assert refused.status_code == 429
            # No worker drains the queue: the longest Retry-After.
            assert refused.headers["retry-after"] == "30"
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
            assert "background queue is full (3 requests waiting, limit 3)" in error["message"]
            # Realtime has room of its own.
            assert (await send("realtime")).status_code == 200
            metrics = (await client.get("/metrics")).text
            assert 'tailcut_requests_shed_total{tier="background"} 4.0' in metrics
        # Exactly the accepted requests were enqueued: a 429 never reaches the streams.
        lengths = {tier: sum([await stack.redis.xlen(stack.keys.intake(tier, b)) for b in ("short", "medium", "long")])
                   for tier in ("background", "realtime")}  # fmt: skip
        assert lengths == {"background": 3, "realtime": 1}


async def test_a_normal_queue_whose_oldest_request_waited_its_bound_sheds_with_429(
    redis_url: str, tiny_model: Path
) -> None:
    # No workers: the first request waits. The normal tier's wait is bounded at 0.4 s, its count is not.
    limits = {"shed_normal_wait_ms": 400, "shed_probe_interval_s": 0.05}
    async with running_stack(redis_url, tiny_model, None, **limits) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:

            async def send(tier: str) -> httpx.Response:
                body = {"prompt": [5, 6, 7], "max_tokens": 4, "tier": tier, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body, timeout=2) as response:
                    if response.status_code != 200:
                        await response.aread()
                    return response

            assert [(await send("normal")).status_code for _ in range(3)] == [200, 200, 200]
            await asyncio.sleep(0.6)
            refused = await send("normal")
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert "the normal queue is backed up (its oldest request has waited" in error["message"]
            assert "limit 0.4 s" in error["message"]
            assert 1 <= int(refused.headers["retry-after"]) <= 30
            # Other tiers have no wait bound by default.
            assert (await send("background")).status_code == 200
        lengths = [
            await stack.redis.xlen(stack.keys.intake("normal", bucket)) for bucket in ("short", "medium", "long")
        ]
        assert sum(lengths) == 3, "a 429 never reaches the streams"


async def test_a_body_over_the_limit_is_a_413_and_a_wrong_method_says_which_are_allowed(
    redis_url: str, tiny_model: Path
) -> None:
    async with running_stack(redis_url, tiny_model, None, max_body_bytes=1000) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            big = {"messages": [{"role": "user", "content": "x" * 2000}]}
            refused = await client.post(CHAT, json=big)
            assert refused.status_code == 413, refused.text
            assert refused.json()["error"]["code"] == "request_too_large"

            async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
                yield b'{"messages": [{"role": "user", "content": "'
                for _ in range(20):
                    yield b"x" * 100
                yield b'"}]}'

            streamed = await client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
            assert streamed.status_code == 413, streamed.text
            small = await client.post(CHAT, json={"messages": HELLO, "n": 2})
            assert small.status_code == 400  # under the limit: parsed as usual
            wrong = await client.put(CHAT, json={"messages": HELLO})
            assert wrong.status_code == 405 and wrong.headers["allow"] == "POST", wrong.headers
            assert wrong.json()["error"]["type"] == "invalid_request_error"
        assert all([await stack.redis.xlen(stream) == 0 for stream in stack.keys.intake_all()])
