"""Draining a worker on an operator's word (``POST /admin/workers/{id}/drain``).

The API sets the worker's drain key (``Keys.drain``), only while the worker is alive; the worker's
heartbeat takes it (once: GETDEL) and stops the worker as SIGTERM does — waiting requests go back to
their streams, running ones get their drain time and are then handed back. The key expires after
``DRAIN_REQUEST_TTL_S`` when no worker took it.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from queues import scripts
from queues.keys import DRAIN_REQUEST_TTL_S, Keys

# KEYS: the live-workers sorted set, the worker's drain key. ARGV: worker id, now (epoch s), ttl_s.
# Sets the drain key only while the worker's last beat vouches for it. Returns 1, or 0 (not alive).
REQUEST = """
local vouched = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not vouched or tonumber(vouched) < tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[3])
return 1
"""


async def request_drain(redis: aioredis.Redis, keys: Keys, worker_id: str) -> bool:
    """Ask the live worker ``worker_id`` to drain; False when no live worker has that id."""
    done = await scripts.run(
        redis, REQUEST, [keys.workers, keys.drain(worker_id)], [worker_id, repr(time.time()), DRAIN_REQUEST_TTL_S]
    )
    return bool(done)


async def take_drain_request(redis: aioredis.Redis, keys: Keys, worker_id: str) -> bool:
    """Whether an operator asked ``worker_id`` to drain; the request is taken (a second call says no)."""
    return await redis.getdel(keys.drain(worker_id)) is not None
