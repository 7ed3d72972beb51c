"""Redis clients as tailcut needs them, and the checks a Redis must pass before we use it."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tailcut.errors import ConfigError, ServiceUnavailableError

# Blocking reads (XREADGROUP BLOCK, pub/sub) need a socket timeout longer than the block time, or the
# client gives up on a healthy idle connection.
BLOCKING_MARGIN_S = 5.0


def connect(url: str, *, timeout_s: float) -> aioredis.Redis:
    """Client for short commands: fails within ``timeout_s`` when Redis does not answer."""
    client: aioredis.Redis = aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=30,
    )
    return client


def connect_blocking(url: str, *, block_s: float, connect_timeout_s: float) -> aioredis.Redis:
    """Client for blocking reads of up to ``block_s`` seconds."""
    client: aioredis.Redis = aioredis.Redis.from_url(
        url,
        socket_timeout=block_s + BLOCKING_MARGIN_S,
        socket_connect_timeout=connect_timeout_s,
        health_check_interval=30,
    )
    return client


async def check_redis(redis: aioredis.Redis) -> None:
    """Refuse a Redis that would evict stream entries under memory pressure.

    An evicted intake entry is an accepted request lost without a trace, so tailcut requires
    ``maxmemory-policy noeviction``.
    """
    try:
        info = await redis.info("memory")
    except RedisError as exc:
        raise ServiceUnavailableError(f"Redis does not answer: {exc}") from exc
    policy = info.get("maxmemory_policy", "noeviction")
    if isinstance(policy, bytes):
        policy = policy.decode()
    if policy != "noeviction":
        raise ConfigError(
            f"Redis runs with maxmemory-policy {policy!r}; tailcut needs 'noeviction' so accepted "
            "requests are never evicted. Fix: CONFIG SET maxmemory-policy noeviction "
            "(and put it in redis.conf)."
        )


T = TypeVar("T")


async def reply(pending: Awaitable[T] | T) -> T:
    """redis-py types hash and set commands as sync-or-async; on the asyncio client they are awaitable."""
    return await cast(Awaitable[T], pending)
