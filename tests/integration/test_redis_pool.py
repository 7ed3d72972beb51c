"""The pools of ``queues.connection`` against a real Redis: a connection taken from the pool is checked
without a read of its socket, and one the server closed while it sat in the pool is replaced before a
command goes out on it."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from queues.connection import connect


async def pooled_client_id(client: aioredis.Redis) -> int:
    """The server's id of the pool's one connection (the pool holds one after a command)."""
    return int(await client.client_id())


async def test_a_connection_the_server_closed_in_the_pool_is_replaced_before_the_next_command(redis_url: str) -> None:
    client = connect(redis_url, timeout_s=2.0)
    killer = aioredis.Redis.from_url(redis_url)
    try:
        before = await pooled_client_id(client)
        assert await killer.client_kill_filter(_id=before) == 1
        await asyncio.sleep(0.1)  # the event loop sees the close on the idle socket
        assert await client.ping()  # not a ConnectionError: the closed connection was not used
        assert await pooled_client_id(client) != before
    finally:
        await client.aclose()
        await killer.aclose()


async def test_a_connection_taken_from_the_pool_is_not_probed_with_a_read(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = connect(redis_url, timeout_s=2.0)
    try:
        await client.ping()
        connection = client.connection_pool._available_connections[0]  # type: ignore[attr-defined]
        probes = 0
        probe = connection.can_read_destructive

        async def counted() -> bool:
            nonlocal probes
            probes += 1
            return bool(await probe())

        monkeypatch.setattr(connection, "can_read_destructive", counted)
        for _ in range(5):
            assert await client.ping()
        assert probes == 0
    finally:
        await client.aclose()
