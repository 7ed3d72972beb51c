"""Test harness: the real pipeline in the test process (uvicorn API + workers on the shared engine).

Everything talks over real sockets: HTTP on loopback, a real Redis. Each stack gets its own key
prefix so tests never see each other's streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis
import uvicorn
from redis.exceptions import RedisError

from api.app import create_app
from api.settings import ApiSettings
from queues.connection import connect, connect_blocking
from queues.keys import Keys
from workers.engines.base import Engine
from workers.settings import WorkerSettings
from workers.worker import Worker


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}:"


@dataclass
class Stack:
    base_url: str
    keys: Keys
    redis: aioredis.Redis
    api_settings: ApiSettings
    workers: list[Worker] = field(default_factory=list)


@contextlib.asynccontextmanager
async def running_api(settings: ApiSettings, model_dir: Path) -> AsyncIterator[str]:
    """Serve the API with uvicorn on a free loopback port; yields its base URL."""
    config = uvicorn.Config(
        create_app(settings, model_dir=model_dir), host="127.0.0.1", port=0, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def running_workers(
    settings: list[WorkerSettings], engine: Engine, redis_url: str
) -> AsyncIterator[list[Worker]]:
    clients: list[aioredis.Redis] = []
    workers: list[Worker] = []
    for worker_settings in settings:
        redis = connect(redis_url, timeout_s=1.0)
        blocking = connect_blocking(redis_url, block_s=worker_settings.read_block_ms / 1000, connect_timeout_s=1.0)
        clients += [redis, blocking]
        workers.append(Worker(worker_settings, engine, redis, blocking))
    tasks = [asyncio.create_task(worker.run()) for worker in workers]
    try:
        yield workers
    finally:
        for worker in workers:
            worker.stop()
        await asyncio.gather(*tasks)
        for client in clients:
            await client.aclose()


@contextlib.asynccontextmanager
async def running_stack(
    redis_url: str, model_dir: Path, engine: Engine | None, *, num_workers: int = 1, **api_overrides: object
) -> AsyncIterator[Stack]:
    prefix = unique_prefix()
    api_settings = ApiSettings(redis_url=redis_url, key_prefix=prefix, model=str(model_dir), **api_overrides)  # type: ignore[arg-type]
    worker_settings = [
        WorkerSettings(
            redis_url=redis_url,
            key_prefix=prefix,
            model=str(model_dir),
            worker_id=f"w{index}-{prefix}",
            read_block_ms=200,
            drain_timeout_s=5,
        )
        for index in range(num_workers if engine is not None else 0)
    ]
    redis = connect(redis_url, timeout_s=1.0)
    try:
        async with running_api(api_settings, model_dir) as base_url:
            async with running_workers(worker_settings, engine, redis_url) if engine else _no_workers() as workers:
                yield Stack(base_url, Keys(prefix), redis, api_settings, workers)
    finally:
        with contextlib.suppress(RedisError):  # a test may have killed its Redis
            await _delete_prefix(redis, prefix)
        await redis.aclose()


@contextlib.asynccontextmanager
async def _no_workers() -> AsyncIterator[list[Worker]]:
    yield []


async def _delete_prefix(redis: aioredis.Redis, prefix: str) -> None:
    keys = [key async for key in redis.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await redis.delete(*keys)


@dataclass
class RedisServer:
    url: str
    process: subprocess.Popen[bytes]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


@contextlib.contextmanager
def private_redis_server(port: int, *extra: str) -> Iterator[RedisServer]:
    """A redis-server of the test's own on ``port`` (for FLUSHALL, kill, or other settings)."""
    import redis as sync_redis

    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = sync_redis.Redis.from_url(url, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except sync_redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()
        yield RedisServer(url, process)
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=10)
