"""vLLM's prefix cache salted per tenant (real engine, CPU, tiny model): a tenant's repeated prompt finds
its own blocks cached, another tenant's identical prompt finds none of them — so its latency cannot tell
it what the first one sent — unless the operator lets tenants share the cache. Prefix warmup fills the
cache of the tenant it is told to warm for."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import httpx
import pytest

from queues.messages import SamplingSpec
from tests.stack import running_stack
from workers.engines.base import EngineDelta, OutputSink
from workers.engines.vllm_engine import VllmEngine
from workers.settings import cache_salt

pytestmark = pytest.mark.engine

BLOCK = 32  # vLLM's CPU block size: only full blocks are cached


class CacheHits:
    """The shared engine, recording how many prompt tokens its prefix cache served per request."""

    def __init__(self, engine: VllmEngine) -> None:
        self._engine = engine
        self.cached: dict[str, int] = {}
        self.salts: dict[str, str | None] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        priority: int,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[EngineDelta, None]:
        self.salts[request_id] = cache_salt
        deltas = self._engine.generate(request_id, prompt_token_ids, sampling, priority=priority, cache_salt=cache_salt)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                self.cached.setdefault(request_id, delta.num_cached_tokens)
                yield delta

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
        """The worker's path (``generate`` is the prefix warmer's)."""
        self.salts[request_id] = cache_salt
        hits = self

        class Recording:
            def on_delta(self, delta: EngineDelta) -> None:
                hits.cached.setdefault(request_id, delta.num_cached_tokens)
                sink.on_delta(delta)

            def on_error(self, error: BaseException) -> None:
                sink.on_error(error)

        await self._engine.submit(
            request_id, prompt_token_ids, sampling, priority=priority, cache_salt=cache_salt, sink=Recording()
        )


async def cached_for(client: httpx.AsyncClient, hits: CacheHits, prompt: list[int], tenant: str | None) -> int:
    headers = {"X-Tailcut-Tenant": tenant} if tenant is not None else {}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    answer = await client.post("/v1/completions", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    request_id = answer.headers["x-tailcut-request-id"]
    (engine_id,) = [key for key in hits.cached if key.startswith(request_id)]
    return hits.cached[engine_id]


@pytest.mark.parametrize("shared", [False, True])
async def test_a_tenant_never_hits_another_tenants_prefix_cache_unless_sharing_is_on(
    redis_url: str, tiny_model: Path, engine: VllmEngine, shared: bool
) -> None:
    hits = CacheHits(engine)
    prompt = [100 + shared * 1000 + index for index in range(7 * BLOCK + 5)]  # 7 full blocks
    full = 7 * BLOCK
    async with running_stack(redis_url, tiny_model, hits, worker={"prefix_cache_shared": shared}) as stack:  # type: ignore[arg-type]
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            first = await cached_for(client, hits, prompt, "acme")
            again = await cached_for(client, hits, prompt, "acme")
            other = await cached_for(client, hits, prompt, "globex")
            unnamed = await cached_for(client, hits, prompt, None)
            unnamed_again = await cached_for(client, hits, prompt, None)
    assert first == 0
    assert again == full  # the same tenant: every full block of its own prompt
    if shared:
        assert other == full and unnamed == full
        assert set(hits.salts.values()) == {None}
    else:
        assert other == 0  # another tenant: none of them
        assert unnamed == 0 and unnamed_again == full  # requests naming no tenant share their own cache
        assert {salt for salt in hits.salts.values()} == {"tenant:acme", "tenant:globex", None}


async def test_prefix_warmup_fills_the_cache_of_the_tenant_it_warms_for(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    hits = CacheHits(engine)
    warmed = [600 + index for index in range(5 * BLOCK + 3)]
    worker = {"warmup": {"prefix_tenant": "acme"}}
    async with running_stack(redis_url, tiny_model, hits, worker=worker, prefixes=[warmed]) as stack:  # type: ignore[arg-type]
        (running,) = stack.workers
        warmer = running.prefix_warmer
        assert warmer is not None
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            async with asyncio.timeout(30):
                while not warmer.finished:
                    await asyncio.sleep(0.05)
            assert warmer.done == 1, "the warmup prompt was refused"
            other = await cached_for(client, hits, warmed, "globex")
            own = await cached_for(client, hits, warmed, "acme")
    assert [salt for key, salt in hits.salts.items() if key.startswith("warmup-")] == [cache_salt("acme", shared=False)]
    assert own == 5 * BLOCK and other == 0
