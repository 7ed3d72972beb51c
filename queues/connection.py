"""Redis clients as tailcut needs them, and the checks a Redis must pass before we use it.

A process reaches Redis either at one URL or through Redis Sentinel (``RedisEndpoint.sentinels``):
then each new connection asks the Sentinels for the current primary, so after a failover the next
connection goes to the new one. Connections to a demoted primary fail (Sentinel closes them, and a
write there answers READONLY, which drops the connection); every caller already treats a failed
command as Redis being away for a moment and retries or answers 503, so a failover needs no restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, ConnectionPool, SSLConnection, parse_url
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.exceptions import RedisError

from tailcut.errors import ConfigError, ServiceUnavailableError
from tailcut.settings import RedisEndpoint

# Blocking reads (XREADGROUP BLOCK, pub/sub) need a socket timeout longer than the block time, or the
# client gives up on a healthy idle connection.
BLOCKING_MARGIN_S = 5.0


class _QuickCheck(ConnectionPool):
    """A pool whose check of a connection it hands out reads no socket.

    redis-py's check (``ConnectionPool.ensure_connection``) probes every connection taken from the pool
    with a read under a zero timeout: a cancelled read, an exception and a turn of the event loop on
    every command, 10 µs of CPU here (BENCHMARKS.md), a tenth of what the command costs. What it looks
    for is already known without it: an idle connection's socket stays watched by the event loop, so a
    close by the server (a restart, a failover) or data nobody asked for are in its stream by now. A
    connection showing either is replaced, as redis-py replaces it; one closed in this very instant fails
    its command, as it could after redis-py's probe too.
    """

    async def ensure_connection(self, connection: AbstractConnection) -> None:
        stream = getattr(connection, "_reader", None)
        parser: Any = getattr(getattr(connection, "_parser", None), "_reader", None)
        buffered = getattr(stream, "_buffer", None)
        if not isinstance(stream, asyncio.StreamReader) or buffered is None or not hasattr(parser, "has_data"):
            # Not connected yet, or a redis-py that keeps these elsewhere: its own check.
            await super().ensure_connection(connection)
            return
        if stream.at_eof() or stream.exception() is not None or buffered or parser.has_data():
            await connection.disconnect()
        await connection.connect()  # type: ignore[no-untyped-call]


class _SentinelPool(_QuickCheck, SentinelConnectionPool):
    """A Sentinel-backed pool that also closes its Sentinel clients when the pool itself is closed
    (``disconnect()`` with in-use connections; a primary change calls it with idle ones only)."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:
            for client in self.sentinel_manager.sentinels:
                await client.aclose()


def connection_pool(endpoint: str | RedisEndpoint, **options: Any) -> ConnectionPool:
    """A pool for ``endpoint`` with redis-py connection ``options`` (timeouts, health checks)."""
    if isinstance(endpoint, str):
        endpoint = RedisEndpoint(endpoint)
    if not endpoint.sentinels:
        return _QuickCheck.from_url(endpoint.url, **options)
    data = {key: value for key, value in parse_url(endpoint.url).items() if key not in ("host", "port", "path")}
    if data.pop("connection_class", None) is SSLConnection:
        data["ssl"] = True
    sentinel_options = {
        key: value for key, value in options.items() if key in ("socket_timeout", "socket_connect_timeout")
    }
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(endpoint.sentinels),
        sentinel_kwargs={
            **sentinel_options,
            "username": endpoint.sentinel_username,
            "password": endpoint.sentinel_password,
        },
    )
    return _SentinelPool(endpoint.master, sentinel, **data, **options)  # type: ignore[no-untyped-call]


def connect(endpoint: str | RedisEndpoint, *, timeout_s: float) -> aioredis.Redis:
    """Client for short commands: fails within ``timeout_s`` when Redis does not answer."""
    pool = connection_pool(
        endpoint, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=30
    )
    return aioredis.Redis.from_pool(pool)


def connect_blocking(endpoint: str | RedisEndpoint, *, block_s: float, connect_timeout_s: float) -> aioredis.Redis:
    """Client for blocking reads of up to ``block_s`` seconds."""
    pool = connection_pool(
        endpoint,
        socket_timeout=block_s + BLOCKING_MARGIN_S,
        socket_connect_timeout=connect_timeout_s,
        health_check_interval=30,
    )
    return aioredis.Redis.from_pool(pool)


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
