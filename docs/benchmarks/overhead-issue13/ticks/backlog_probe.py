"""The worker's backlog probe alone: CPU and wall time per call of ``queues.intake.backlog`` against a Redis
(default 127.0.0.1:6379, keys under a throwaway prefix, deleted after), 1,000 calls after one warm-up, twice.
Run from a checkout of 8ba9d20 (a pipeline of one XINFO GROUPS per stream) and of bb4f62d (one script call),
``PYTHONPATH=. .venv/bin/python docs/benchmarks/overhead-issue13/ticks/backlog_probe.py [REDIS_URL]`` (the
runs of BENCHMARKS.md, alternated: ``backlog_probe.txt``).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid

from queues import intake
from queues.connection import connect
from queues.keys import BUCKETS, TIERS, Keys

CALLS = 1000


async def main(url: str) -> None:
    redis = connect(url, timeout_s=5.0)
    keys = Keys(f"probe-{uuid.uuid4().hex[:8]}:")
    try:
        await intake.ensure_groups(redis, keys)
        streams = [keys.intake(tier, bucket) for tier in TIERS for bucket in BUCKETS]
        for _ in range(2):
            await intake.backlog(redis, streams)
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(CALLS):
                await intake.backlog(redis, streams)
            cpu_us = (time.process_time() - cpu) / CALLS * 1e6
            wall_us = (time.perf_counter() - wall) / CALLS * 1e6
            print(f"backlog of {len(streams)} streams: {cpu_us:.0f} µs of CPU, {wall_us:.0f} µs wall per call")
    finally:
        names = [name async for name in redis.scan_iter(match=f"{keys.prefix}*")]
        if names:
            await redis.delete(*names)
        await redis.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379/0"))
