"""The prefix keep-alive on the real engine (vLLM on CPU, tiny model): a finished realtime turn stays in
vLLM's prefix cache through more other traffic than the cache holds, because the worker touches it
(``workers.retention``); without keep-alive the same traffic evicts it."""

from __future__ import annotations

import math
import random
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_cache_salt import BLOCK, CacheHits
from tests.stack import running_stack
from workers.engines.vllm_engine import VllmEngine
from workers.settings import cache_salt

pytestmark = pytest.mark.engine

FILLER_TOKENS = 1000  # each document of the other traffic


async def cached(client: httpx.AsyncClient, hits: CacheHits, prompt: list[int], *, tier: str, tenant: str) -> int:
    """Send ``prompt``; how many of its tokens the engine served from its prefix cache."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "tier": tier}
    answer = await client.post("/v1/completions", json=body, headers={"X-Tailcut-Tenant": tenant})
    assert answer.status_code == 200, answer.text
    request_id = answer.headers["x-tailcut-request-id"]
    (engine_id,) = [key for key in hits.cached if key.startswith(request_id)]
    return hits.cached[engine_id]


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "not-kept"])
async def test_a_chat_turn_outlives_more_other_traffic_than_the_cache_holds_while_kept(
    redis_url: str, tiny_model: Path, engine: VllmEngine, keep: bool
) -> None:
    hits = CacheHits(engine)
    # Random ids of the tiny model's vocabulary, seeded per case: no block is left over from the
    # other case or another test.
    rng = random.Random(f"keep-alive-{keep}")

    def ids(count: int) -> list[int]:
        return [rng.randrange(2048) for _ in range(count)]

    history = ids(5 * BLOCK)  # a chat's first turn: 5 whole blocks
    # Then documents of another tenant, one after another, 1.5 times what the KV cache holds.
    num_filler = math.ceil(1.5 * engine.kv_capacity_tokens / FILLER_TOKENS)
    scheduler = {"keep_alive_ttl_s": 120.0 if keep else 0.0, "keep_alive_min_return_share": 0.0}
    async with running_stack(redis_url, tiny_model, hits, worker={"scheduler": scheduler}) as stack:  # type: ignore[arg-type]
        (worker,) = stack.workers
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            assert await cached(client, hits, history, tier="realtime", tenant="acme") == 0
            for _ in range(num_filler):
                assert await cached(client, hits, ids(FILLER_TOKENS), tier="normal", tenant="globex") == 0
            # The next turn: the history and a new question.
            next_turn = [*history, *ids(40)]
            found = await cached(client, hits, next_turn, tier="realtime", tenant="acme")
        touches = worker.num_touches
    touch_salts = {salt for request_id, salt in hits.salts.items() if request_id.startswith("keep-")}
    if keep:
        assert found == len(history), f"the kept history was evicted ({touches} touches)"
        assert touches > 0 and touch_salts == {cache_salt("acme", shared=False)}
        touched = {key: num_cached for key, num_cached in hits.cached.items() if key.startswith("keep-")}
        assert all(touched.values()), f"a touch found its prefix evicted: {touched}"
    else:
        assert found == 0, "the other traffic did not evict the history: the test proves nothing"
        assert touches == 0 and not touch_salts
