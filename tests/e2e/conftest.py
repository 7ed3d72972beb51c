"""Shared by the end-to-end tests that drive workers directly (no HTTP): a key prefix, Redis
clients, and a reply router subscribed as the API would be."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from queues import intake
from queues.connection import connect, connect_blocking
from queues.keys import Keys
from queues.replies import ReplyRouter
from tests.stack import unique_prefix

# Reply channel id of the router below; tests.e2e.test_recovery.message_for() replies there.
API_ID = "api-recovery"


@pytest.fixture
async def setup(redis_url: str) -> AsyncIterator[tuple[aioredis.Redis, Keys, ReplyRouter]]:
    keys = Keys(unique_prefix())
    redis = connect(redis_url, timeout_s=5.0)
    pubsub = connect_blocking(redis_url, block_s=1.0, connect_timeout_s=1.0)
    router = ReplyRouter(redis, pubsub, keys, API_ID, poll_max_s=0.5)
    await router.start(wait_s=5)
    await intake.ensure_groups(redis, keys)
    yield redis, keys, router
    await router.stop()
    found = [key async for key in redis.scan_iter(match=f"{keys.prefix}*")]
    if found:
        await redis.delete(*found)
    await pubsub.aclose()
    await redis.aclose()
