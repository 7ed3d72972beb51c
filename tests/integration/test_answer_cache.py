"""The answer cache's LRU-K on a real Redis, against a plain reference model on random traces; admission on
the K-th reference within the window; TTL and model staleness."""

from __future__ import annotations

import asyncio
import random

import redis.asyncio as aioredis

from queues.answers import AnswerStore, CacheConfig
from queues.keys import Keys

MODEL = "tiny@1"


class ReferenceLruK:
    """LRU-K as the literature states it, in memory: a key is cached on its K-th reference within the
    window; past the capacity, the cached key whose K-th most recent reference is oldest goes."""

    def __init__(self, k: int, window: int, capacity: int) -> None:
        self.k, self.window, self.capacity = k, window, capacity
        self.history: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}  # key -> K-th most recent reference (its eviction score)

    def reference(self, key: str, now: int) -> bool:
        """One reference (a hit is served; a miss is generated and, when admitted, stored); True on a hit."""
        refs = [now, *self.history.get(key, [])][: self.k]
        self.history[key] = refs
        inside = [at for at in refs if at > now - self.window]
        if key in self.cached:
            if len(inside) >= self.k:
                self.cached[key] = inside[-1]
            return True
        if len(inside) >= self.k:
            self.cached[key] = inside[-1]
            while len(self.cached) > self.capacity:
                victim = min(self.cached, key=lambda name: (self.cached[name], name))
                del self.cached[victim]
        return False


async def test_lru_k_keeps_what_the_reference_model_keeps_on_random_traces(
    prefixed_redis: tuple[aioredis.Redis, Keys],
) -> None:
    redis, keys = prefixed_redis
    for seed in range(4):
        rng = random.Random(seed)
        # One reference a virtual second, a 40 s window: the history's Redis expiry (real time, the
        # window's length) cannot pass during the test, however slow the machine.
        config = CacheConfig(k=2, history_s=40, ttl_s=3600, max_entries=5)
        prefix = Keys(f"{keys.prefix}{seed}:")
        store = AnswerStore(redis, prefix, config)
        model = ReferenceLruK(k=2, window=40_000, capacity=5)
        # A skewed key space: a few hot keys among many cold ones, as repeated questions are.
        names = [f"k{index}" for index in range(30)]
        weights = [1 / (index + 1) ** 1.2 for index in range(30)]
        for now in range(1000, 400_000, 1000):
            name = rng.choices(names, weights)[0]
            found = await store.reference(name, MODEL, now_ms=now)
            expected_hit = model.reference(name, now)
            assert (found.result == "hit") == expected_hit, (seed, now, name, found)
            if found.result == "admit":
                await store.store(name, MODEL, f"answer of {name}".encode(), score=found.score)
            assert sorted(await store.cached()) == sorted(model.cached), (seed, now)
        assert len(model.cached) == 5, "the trace never filled the cache: it tests nothing"


async def test_a_key_is_cached_only_on_its_kth_reference_inside_the_window(
    prefixed_redis: tuple[aioredis.Redis, Keys],
) -> None:
    redis, keys = prefixed_redis
    store = AnswerStore(redis, keys, CacheConfig(k=2, history_s=10, max_entries=10))
    assert (await store.reference("q", MODEL, now_ms=1_000)).result == "miss"
    # Second reference, 11 s later: the first has left the window.
    assert (await store.reference("q", MODEL, now_ms=12_000)).result == "miss"
    second = await store.reference("q", MODEL, now_ms=13_000)
    assert second.result == "admit" and second.score == 12_000
    await store.store("q", MODEL, b'{"text": "Paris"}', score=second.score)
    hit = await store.reference("q", MODEL, now_ms=14_000)
    assert hit.result == "hit" and hit.reply == b'{"text": "Paris"}'


async def test_entries_expire_with_their_ttl_and_a_changed_model_makes_them_stale(
    prefixed_redis: tuple[aioredis.Redis, Keys],
) -> None:
    redis, keys = prefixed_redis
    store = AnswerStore(redis, keys, CacheConfig(k=1, history_s=60, ttl_s=0.3, max_entries=10))
    first = await store.reference("q", MODEL, now_ms=1)
    assert first.result == "admit"
    await store.store("q", MODEL, b"old", score=first.score)
    assert (await store.reference("q", MODEL, now_ms=2)).result == "hit"
    await asyncio.sleep(0.4)
    assert (await store.reference("q", MODEL, now_ms=3)).result == "admit", "expired by its TTL"
    assert await store.cached() == []
    await store.store("q", MODEL, b"old", score=3)
    assert (await store.reference("q", "tiny@2", now_ms=4)).result == "stale"
    assert await store.cached() == [] and not await redis.exists(keys.answer("q"))
