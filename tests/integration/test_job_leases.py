"""Runner leases on a real Redis: a job whose arq in-progress mark names a jobs process without a lease
(killed, or stopped while Redis was away) becomes runnable at once; a live runner's, or a run that has
only just started, is left alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from arq.constants import in_progress_key_prefix

from jobs.runner import LEASE_BEAT_S, JobRunner
from jobs.settings import JobsSettings
from queues.connection import connect
from queues.jobs import JobLeases, JobStore
from queues.keys import Keys
from tests.stack import unique_prefix

IN_PROGRESS_S = 60.0


@pytest.fixture
async def setup(redis_url: str) -> AsyncIterator[tuple[aioredis.Redis, Keys]]:
    keys = Keys(unique_prefix())
    redis = connect(redis_url, timeout_s=1.0)
    yield redis, keys
    found = [key async for key in redis.scan_iter(match=f"{keys.prefix}*")]
    found += [in_progress_key_prefix + f"{keys.prefix}{name}" for name in ("old", "young", "live", "never")]
    await redis.delete(*found)
    await redis.aclose()


async def held(redis: aioredis.Redis, keys: Keys, job_id: str, *, age_s: float, runner: str | None) -> None:
    """A job arq started ``age_s`` ago (its in-progress mark lives IN_PROGRESS_S from the start)."""
    await redis.zadd(keys.arq_queue, {job_id: 1})
    await redis.psetex(in_progress_key_prefix + job_id, int((IN_PROGRESS_S - age_s) * 1000), b"1")
    store = JobStore(redis, keys)
    await store.create(job_id, num_chunks=1, total=1, ttl_s=600)
    if runner is not None:
        await store.mark_running(job_id, done=0, failed=0, attempt=1, runner=runner)


async def test_jobs_of_gone_runners_are_released_and_the_rest_kept(setup: tuple[aioredis.Redis, Keys]) -> None:
    redis, keys = setup
    names = {name: f"{keys.prefix}{name}" for name in ("old", "young", "live", "never")}
    mine = JobLeases(redis, keys, "alive", beat_s=1.0, in_progress_s=IN_PROGRESS_S)
    await mine.renew()
    await held(redis, keys, names["old"], age_s=20, runner="gone")
    await held(redis, keys, names["young"], age_s=1, runner="gone")  # its runner may not have named itself yet
    await held(redis, keys, names["live"], age_s=20, runner="alive")
    await held(redis, keys, names["never"], age_s=20, runner=None)  # died before naming itself
    assert sorted(await mine.reclaim()) == sorted([names["old"], names["never"]])
    assert not await redis.exists(in_progress_key_prefix + names["old"])
    assert await redis.exists(in_progress_key_prefix + names["young"])
    assert await redis.exists(in_progress_key_prefix + names["live"])
    progress = await JobStore(redis, keys).read(names["old"])
    assert progress is not None and progress.status == "queued"
    # Once the live runner's lease is gone, its job is released too.
    await mine.release()
    other = JobLeases(redis, keys, "other", beat_s=1.0, in_progress_s=IN_PROGRESS_S)
    assert await other.reclaim() == [names["live"]]


async def test_the_lease_loop_ends_on_its_stop_and_releases_the_lease(
    setup: tuple[aioredis.Redis, Keys], redis_url: str, tiny_model: Path
) -> None:
    """A stopping jobs process ends its lease loop by ``stop_leases()``, not by a cancel (which redis-py
    can lose mid-command, and the loop then beats on), and deletes its lease on the way out."""
    redis, keys = setup
    settings = JobsSettings(redis_url=redis_url, key_prefix=keys.prefix, model=str(tiny_model))
    runner = await JobRunner.open(settings, tiny_model)
    try:
        lease = keys.jobs_runner(settings.jobs_runner_id)
        beating = asyncio.create_task(runner.keep_leases())
        async with asyncio.timeout(5):
            while not await redis.exists(lease):
                await asyncio.sleep(0.02)
        runner.stop_leases()
        async with asyncio.timeout(LEASE_BEAT_S / 2):  # at once: not after the next beat
            await beating
        assert not await redis.exists(lease)
    finally:
        await runner.close()
