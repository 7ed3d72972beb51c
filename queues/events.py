"""The operators' event stream ``tc:events``: breaker changes, scale-up signals, degradations, loop-lag
and GPU-memory warnings, one entry each, written best effort by any process."""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from queues.keys import Keys
from tailcut.logs import log_event

log = logging.getLogger("tailcut.events")

# The stream keeps about this many entries.
EVENTS_KEPT = 10_000


async def publish(redis: aioredis.Redis, keys: Keys, event: dict[str, object], *, source: dict[str, str]) -> None:
    """Append ``event`` (its ``type`` and fields) with ``source`` (who writes it: ``worker=...``) and the
    time; a Redis error is logged, never raised."""
    entry: dict[FieldT, EncodableT] = {"type": str(event.get("type", "event"))}
    for key, text in source.items():
        entry[key] = text
    entry["at_ms"] = int(time.time() * 1000)
    for key, value in event.items():
        if key != "type":
            entry[key] = value if isinstance(value, int | float | str) else str(value)
    try:
        await redis.xadd(keys.events, entry, maxlen=EVENTS_KEPT, approximate=True)
    except RedisError as exc:
        log_event(log, "event_write_failed", logging.WARNING, kind=entry["type"], error=str(exc))
