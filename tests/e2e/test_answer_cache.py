"""The answer cache end to end on the real engine (CPU, tiny model), read by the ``openai`` client: the
K-th repeat of a deterministic request is stored, the next is served without the engine and is the same
reply but for its ``tailcut`` marker; another tenant never gets it; a sampled request is never cached.
The tiny-request pool is shared across tenants only without tenant context; seeded answers are the Q&A
file's, marked so, for exactly their questions."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.stack import running_stack
from workers.engines.vllm_engine import VllmEngine

pytestmark = pytest.mark.engine

MESSAGES = [{"role": "user", "content": "What are your opening hours?"}]


async def streamed(client: AsyncOpenAI, **extra: Any) -> list[dict[str, Any]]:
    stream = await client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    return [chunk.to_dict() async for chunk in stream]


def comparable(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chunks without what differs between two requests anyway (id, time) or marks a cached reply."""
    return [{key: value for key, value in chunk.items() if key not in ("id", "created", "tailcut")} for chunk in chunks]


def content(chunks: list[dict[str, Any]]) -> str:
    return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])


async def test_a_repeated_greedy_request_is_answered_from_the_cache_as_the_engine_answered_it(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    async with running_stack(redis_url, tiny_model, engine, cache_enabled=True) as stack:
        (worker,) = stack.workers
        client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
        greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
        first = await streamed(client, **greedy)
        second = await streamed(client, **greedy)  # the K-th (2nd) reference: generated, then stored
        async with asyncio.timeout(10):
            # A reply reaches its client before its worker counts it, and before the API stores it.
            while len(worker.served_ids) < 2 or not await stack.redis.zcard(stack.keys.answer_index()):
                await asyncio.sleep(0.02)
        served_before = len(worker.served_ids)
        third = await streamed(client, **greedy)  # a hit
        whole = await client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},  # type: ignore[arg-type]
        )
        assert len(worker.served_ids) == served_before == 2, "the hits reached a worker"
        other_tenant = await streamed(client, **greedy, user="another-tenant")
        sampled = [await streamed(client, temperature=1.0) for _ in range(3)]
        async with asyncio.timeout(10):
            while len(worker.served_ids) < 2 + 1 + 3:
                await asyncio.sleep(0.02)
        assert len(worker.served_ids) == 2 + 1 + 3, "another tenant's and sampled requests all run"
        async with httpx.AsyncClient(base_url=stack.base_url) as http:
            metrics = (await http.get("/metrics")).text
        await client.close()
    assert comparable(third) == comparable(second), "the cached reply differs from the one it stored"
    assert [chunk.get("tailcut") for chunk in third if chunk.get("tailcut")] == [{"cache": "hit"}]
    assert not any(chunk.get("tailcut") for chunk in second + other_tenant)
    text = content(second)
    assert whole.choices[0].message.content == text and text
    assert (whole.model_extra or {}).get("tailcut") == {"cache": "hit"}
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert content(other_tenant) == content(first) == text, "same model, same greedy answer, but generated"
    lookups = {
        (sample.labels["result"]): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "tailcut_answer_cache_lookups_total" and sample.labels["tier"] == "normal"
    }
    # first: miss; second: admit; third and the whole body: hits; the other tenant's: a miss of its own key.
    assert lookups == {"miss": 2, "admit": 1, "hit": 2, "stale": 0}, lookups
    assert len(sampled) == 3


def lookups_of(metrics: str, family: str) -> dict[str, float]:
    return {
        sample.labels["result"]: sample.value
        for parsed in text_string_to_metric_families(metrics)
        for sample in parsed.samples
        if sample.name == f"{family}_lookups_total" and sample.labels["tier"] == "normal"
    }


async def test_a_tiny_request_without_tenant_context_is_shared_by_every_tenant_and_nothing_else_is(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    async with running_stack(redis_url, tiny_model, engine, cache_enabled=True) as stack:
        (worker,) = stack.workers
        client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")

        async def ask(messages: list[dict[str, str]], tenant: str) -> list[dict[str, Any]]:
            stream = await client.chat.completions.create(
                model="tiny",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=8,
                stream=True,
                temperature=0,
                user=tenant,
                extra_body={"ignore_eos": True},
            )
            return [chunk.to_dict() async for chunk in stream]

        async def stored(pool: str, count: int) -> None:
            async with asyncio.timeout(10):  # a reply reaches its client before the API stores it
                while await stack.redis.zcard(stack.keys.answer_index(pool)) < count:
                    await asyncio.sleep(0.02)

        hello = [{"role": "user", "content": "hi"}]  # 2 tokens of the tiny model's
        with_system = [{"role": "system", "content": "you are acme's desk"}, *hello]
        longer = [{"role": "user", "content": "What are your opening hours?"}]  # 19 tokens
        for messages in (hello, with_system, longer):
            await ask(messages, "acme")
            await ask(messages, "acme")  # the K-th reference: stored
        await stored("tiny", 1)
        await stored("", 2)
        served_before = len(worker.served_ids)
        shared = await ask(hello, "globex")
        assert len(worker.served_ids) == served_before, "the tiny request reached a worker"
        with_context = await ask(with_system, "globex")
        not_tiny = await ask(longer, "globex")
        async with asyncio.timeout(10):
            while len(worker.served_ids) < served_before + 2:
                await asyncio.sleep(0.02)
        async with httpx.AsyncClient(base_url=stack.base_url) as http:
            metrics = (await http.get("/metrics")).text
        await client.close()
    assert [chunk.get("tailcut") for chunk in shared if chunk.get("tailcut")] == [{"cache": "hit", "pool": "tiny"}]
    assert content(shared), "an empty reply proves nothing"
    assert not any(chunk.get("tailcut") for chunk in with_context + not_tiny), "another tenant's context was shared"
    # Only "hi" went to the tiny pool: miss, admit, then globex's hit.
    assert lookups_of(metrics, "tailcut_tiny_pool") == {"miss": 1, "admit": 1, "hit": 1, "stale": 0}
    # The rest stayed in the tenants' own cache: acme's two keys (miss, admit each), globex's two misses.
    assert lookups_of(metrics, "tailcut_answer_cache") == {"miss": 4, "admit": 2, "hit": 0, "stale": 0}
    assert "tailcut_tiny_pool_stored_total 1.0" in metrics


async def test_a_seeded_answer_is_the_files_own_answer_marked_seeded_for_exactly_its_question(
    redis_url: str, tiny_model: Path, engine: VllmEngine, tmp_path: Path
) -> None:
    answer = "Orders ship within one business day; follow yours under Account > Orders."
    qa = tmp_path / "qa.jsonl"
    qa.write_text(
        orjson.dumps({"question": "where is my order", "answer": answer, "hits": 9}).decode()
        + "\n"
        + orjson.dumps({"question": "can I cancel", "answer": "Yes, within an hour.", "system": "acme desk"}).decode()
        + "\n"
    )
    asked = [{"role": "user", "content": "where is my order"}]
    async with running_stack(redis_url, tiny_model, engine, cache_enabled=True, cache_seed_file=qa) as stack:
        (worker,) = stack.workers
        client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")

        async def ask(messages: list[dict[str, str]], **extra: Any) -> list[dict[str, Any]]:
            stream = await client.chat.completions.create(
                model="tiny",
                messages=messages,  # type: ignore[arg-type]
                stream=True,
                stream_options={"include_usage": True},
                **{"temperature": 0, "max_tokens": 200, **extra},
            )
            return [chunk.to_dict() async for chunk in stream]

        seeded = await ask(asked)
        cut = await ask(asked, max_tokens=5)
        with_system = await ask(
            [{"role": "system", "content": "acme desk"}, {"role": "user", "content": "can I cancel"}]
        )
        assert not worker.served_ids, "a seeded answer reached a worker"
        sampled = await ask(asked, temperature=0.8, max_tokens=4)
        without_its_system = await ask([{"role": "user", "content": "can I cancel"}], max_tokens=4)
        async with asyncio.timeout(10):
            while len(worker.served_ids) < 2:
                await asyncio.sleep(0.02)
        async with httpx.AsyncClient(base_url=stack.base_url) as http:
            metrics = (await http.get("/metrics")).text
        await client.close()
    markers = [chunk.get("tailcut") for chunk in seeded if chunk.get("tailcut")]
    assert markers == [{"cache": "seeded"}]
    assert content(seeded) == answer
    finish = [chunk["choices"][0]["finish_reason"] for chunk in seeded + cut if chunk["choices"]]
    assert [reason for reason in finish if reason] == ["stop", "length"]
    assert answer.startswith(content(cut)) and content(cut) != answer
    assert cut[-1]["usage"]["completion_tokens"] <= 5
    assert content(with_system) == "Yes, within an hour."
    assert not any(chunk.get("tailcut") for chunk in sampled + without_its_system), "generated replies are not seeded"
    assert 'tailcut_seeded_answers_total{tier="normal"} 3.0' in metrics
