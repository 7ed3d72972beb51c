"""A jobs process told to stop while Redis does not answer — frozen with SIGSTOP, as a Redis busy in its
own long shutdown or behind a partition looks — ends within seconds instead of waiting out arq's Redis
timeouts for the hand-back of its running job; the job is left to its lease (real redis-server, real
``tailcut jobs`` process, no GPU worker: the job's requests wait in the queue, so it is running)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs.main import CLOSE_WAIT_S
from queues.connection import connect
from queues.jobs import JOB_FUNCTION, JobSpec, JobStore, connect_arq
from queues.keys import Keys
from tailcut.processes import RedisServer, private_redis, start_child, stop_child
from tests.conftest import TEST_MAX_MODEL_LEN

# arq's own Redis timeout is 10 s, and a stop waited on it twice (about 21 s measured) before
# CLOSE_WAIT_S bounded the hand-back: anything under this bound is the bounded stop.
STOP_BOUND_S = CLOSE_WAIT_S + 7


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with private_redis() as server:
        yield server


async def test_a_stop_that_redis_does_not_answer_ends_within_seconds(
    own_redis: RedisServer, tiny_model: Path, tmp_path: Path
) -> None:
    url, redis_child = own_redis.url, own_redis.child
    keys = Keys(f"t{uuid.uuid4().hex[:8]}:")
    env = {
        **os.environ,
        "TAILCUT_REDIS_URL": url,
        "TAILCUT_KEY_PREFIX": keys.prefix,
        "TAILCUT_MODEL": str(tiny_model),
        "TAILCUT_MAX_MODEL_LEN": str(TEST_MAX_MODEL_LEN),
        "TAILCUT_JOBS_METRICS_PORT": "0",
    }
    log_path = tmp_path / "jobs.log"
    jobs = start_child("jobs", [sys.executable, "-m", "tailcut", "jobs"], env, log_path=log_path)
    redis = connect(url, timeout_s=1.0)
    arq = connect_arq(url, queue_name=keys.arq_queue, timeout_s=1.0)
    try:
        spec = JobSpec(lines=[f"10:00:0{i} worker-{i} WARN queue depth {i}" for i in range(8)],
                       instruction="Which queue?", chunk_lines=2, max_tokens=16)  # fmt: skip
        job_id = uuid.uuid4().hex
        await JobStore(redis, keys).create(job_id, num_chunks=len(spec.chunks()), total=spec.num_requests, ttl_s=600)
        await arq.enqueue_job(JOB_FUNCTION, spec.to_payload(), _job_id=job_id)
        deadline = time.monotonic() + 60
        while (progress := await JobStore(redis, keys).read(job_id)) is None or progress.status != "running":
            assert time.monotonic() < deadline and jobs.process.poll() is None, jobs.log_tail()
            await asyncio.sleep(0.1)
        redis_child.process.send_signal(signal.SIGSTOP)
        jobs.process.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        deadline = stopped_at + 60
        while jobs.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        took_s = time.monotonic() - stopped_at
    finally:
        redis_child.process.send_signal(signal.SIGCONT)  # for the clients' close, and private_redis's SIGTERM
        await arq.aclose(close_connection_pool=True)
        await redis.aclose()
        stop_child(jobs, timeout_s=5)
    log = log_path.read_text()
    assert jobs.process.returncode == 0, jobs.log_tail()
    assert took_s < STOP_BOUND_S, f"the stop took {took_s:.1f} s with Redis frozen\n{jobs.log_tail()}"
    assert "jobs_not_handed_back" in log and "jobs_stopped" in log, log
    assert "Traceback" not in log, log
