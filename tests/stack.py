"""Test harness: the real pipeline in the test process (uvicorn API + workers on the shared engine).

Everything talks over real sockets: HTTP on loopback, a real Redis. Each stack gets its own key
prefix so tests never see each other's streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis
from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, result_key_prefix, retry_key_prefix
from fastapi import FastAPI
from redis.exceptions import RedisError

from admission.settings import AdmissionSettings
from api.app import create_app
from api.settings import ApiSettings
from api.shutdown import ApiServer, server_config
from api.state import ApiState
from jobs.arq_worker import build_worker, close_worker, run_worker
from jobs.runner import JobRunner
from jobs.settings import JobsSettings
from queues.connection import connect, connect_blocking
from queues.jobs import connect_arq
from queues.keys import Keys
from tailcut.processes import RedisServer, private_redis
from tailcut.settings import RedisEndpoint
from workers.engines.base import Engine
from workers.prompter import Prompter
from workers.settings import WorkerSettings
from workers.worker import Worker


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}:"


@dataclass
class Api:
    base_url: str
    app: FastAPI
    server: ApiServer

    @property
    def state(self) -> ApiState:
        state: ApiState = self.app.state.tailcut
        return state


@dataclass
class Stack:
    base_url: str
    keys: Keys
    redis: aioredis.Redis
    api_settings: ApiSettings
    api: Api
    workers: list[Worker] = field(default_factory=list)


@contextlib.asynccontextmanager
async def running_api(
    settings: ApiSettings, model_dir: Path, jobs_settings: JobsSettings | None = None
) -> AsyncIterator[Api]:
    """Serve the API with uvicorn on a free loopback port, as ``tailcut api`` does."""
    app = create_app(settings, model_dir=model_dir, jobs_settings=jobs_settings or JobsSettings())
    config = server_config(
        app,
        host="127.0.0.1",
        port=0,
        grace_s=settings.shutdown_grace_s,
        keep_alive_s=settings.keep_alive_s,
        log_level="warning",
        lifespan="on",
    )
    server = ApiServer(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Api(f"http://127.0.0.1:{port}", app, server)
    finally:
        server.should_exit = True
        await task


def redis_fields(redis: str | RedisEndpoint) -> dict[str, str]:
    """The settings fields that point a process at ``redis`` (a URL, or Sentinels)."""
    if isinstance(redis, str):
        return {"redis_url": redis}
    return {
        "redis_url": redis.url,
        "redis_sentinels": ",".join(f"{host}:{port}" for host, port in redis.sentinels),
        "redis_sentinel_master": redis.master,
    }


@contextlib.asynccontextmanager
async def running_workers(
    settings: list[WorkerSettings],
    engine: Engine,
    redis_url: str | RedisEndpoint,
    *,
    prompter: Prompter | None = None,
    prefixes: Sequence[list[int]] = (),
) -> AsyncIterator[list[Worker]]:
    """Workers on the shared engine. Without ``prompter`` nothing degrades to a summary: the tests
    that compare streams with greedy references run on two shared cores, where a 500 ms stall in
    decode is not rare; the degrade tests pass one. ``prefixes``: each worker's prefix warmup."""
    clients: list[aioredis.Redis] = []
    workers: list[Worker] = []
    for worker_settings in settings:
        redis = connect(redis_url, timeout_s=1.0)
        blocking = connect_blocking(redis_url, block_s=worker_settings.read_block_ms / 1000, connect_timeout_s=1.0)
        clients += [redis, blocking]
        workers.append(Worker(worker_settings, engine, redis, blocking, prompter=prompter, prefixes=prefixes))
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
    redis_url: str | RedisEndpoint,
    model_dir: Path,
    engine: Engine | None,
    *,
    num_workers: int = 1,
    jobs: dict[str, object] | None = None,
    worker: dict[str, object] | None = None,
    prompter: Prompter | None = None,
    prefixes: Sequence[list[int]] = (),
    **api_overrides: object,
) -> AsyncIterator[Stack]:
    """``jobs``: ``JobsSettings`` fields for the API's ``/v1/jobs`` routes (limits, defaults);
    ``worker``: ``WorkerSettings`` fields for every worker; ``prompter``: see ``running_workers``.
    ``redis_url``: a URL, or an endpoint naming Sentinels (``tests.sentinel``)."""
    prefix = unique_prefix()
    where = redis_fields(redis_url)
    api_settings = ApiSettings(**where, key_prefix=prefix, model=str(model_dir), **api_overrides)  # type: ignore[arg-type]
    worker_settings = [
        WorkerSettings(
            **where,  # type: ignore[arg-type]
            key_prefix=prefix,
            model=str(model_dir),
            worker_id=f"w{index}-{prefix}",
            read_block_ms=200,
            drain_timeout_s=5,
            **(worker or {}),  # type: ignore[arg-type]
        )
        for index in range(num_workers if engine is not None else 0)
    ]
    # The test's own client: patient, so two busy cores (the engine spinning) do not fail a test's read.
    redis = connect(redis_url, timeout_s=5.0)
    try:
        jobs_settings = JobsSettings(**where, key_prefix=prefix, **(jobs or {}))  # type: ignore[arg-type]
        async with running_api(api_settings, model_dir, jobs_settings) as api:
            workers_running = (
                running_workers(worker_settings, engine, redis_url, prompter=prompter, prefixes=prefixes)
                if engine
                else _no_workers()
            )
            async with workers_running as workers:
                yield Stack(api.base_url, Keys(prefix), redis, api_settings, api, workers)
    finally:
        with contextlib.suppress(RedisError):  # a test may have killed its Redis
            await _delete_prefix(redis, prefix)
        await redis.aclose()


@contextlib.asynccontextmanager
async def _no_workers() -> AsyncIterator[list[Worker]]:
    yield []


@contextlib.asynccontextmanager
async def running_jobs(stack: Stack, model_dir: Path, **overrides: object) -> AsyncIterator[JobRunner]:
    """A jobs process in the test's event loop: the job runner and its arq worker, on the stack's Redis
    and key prefix, admitting chunks with the stack API's admission settings. Yields the runner."""
    admission = stack.api_settings.model_dump(include=set(AdmissionSettings.model_fields))
    settings = JobsSettings(
        **{**admission, "model": str(model_dir), "jobs_poll_delay_s": 0.05, "jobs_result_ttl_s": 600, **overrides}
    )
    runner = await JobRunner.open(settings, model_dir)
    pool = connect_arq(settings.redis_url, queue_name=runner.keys.arq_queue, timeout_s=5.0)
    worker = build_worker(runner, pool, handle_signals=False)
    task = asyncio.create_task(run_worker(worker))
    try:
        yield runner
    finally:
        await close_worker(worker, pool)
        await asyncio.gather(task, return_exceptions=True)
        await runner.close()
        await _delete_arq_jobs(stack.redis, stack.keys)


async def _delete_arq_jobs(redis: aioredis.Redis, keys: Keys) -> None:
    """arq's per-job keys are outside the key prefix: delete those of this stack's jobs."""
    with contextlib.suppress(RedisError):
        job_ids = [
            key.decode().removeprefix(keys.job("")).split(":")[0]
            async for key in redis.scan_iter(match=keys.job("*"), count=1000)
        ]
        prefixes = (job_key_prefix, result_key_prefix, retry_key_prefix, in_progress_key_prefix)
        arq_keys = [f"{prefix}{job_id}" for job_id in set(job_ids) for prefix in prefixes]
        if arq_keys:
            await redis.delete(*arq_keys)
            await redis.zrem(abort_jobs_ss, *set(job_ids))


async def _delete_prefix(redis: aioredis.Redis, prefix: str) -> None:
    keys = [key async for key in redis.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await redis.delete(*keys)


def private_redis_server(port: int, *extra: str) -> contextlib.AbstractContextManager[RedisServer]:
    """A redis-server of the test's own on ``port`` (for FLUSHALL, kill, or other settings); it dies with
    the test process (``tailcut.processes``)."""
    return private_redis(port, *extra)
