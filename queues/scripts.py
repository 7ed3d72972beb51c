"""Running the Lua scripts of the Redis contract (``queues.fencing``, ``queues.requests``)."""

from __future__ import annotations

import weakref
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

_registered: weakref.WeakKeyDictionary[aioredis.Redis, dict[str, AsyncScript]] = weakref.WeakKeyDictionary()


async def run(redis: aioredis.Redis, source: str, keys: list[str], args: list[Any]) -> Any:
    """Run the Lua ``source`` on ``redis`` (EVALSHA, loading it once per client)."""
    scripts = _registered.setdefault(redis, {})
    script = scripts.get(source)
    if script is None:
        script = scripts[source] = redis.register_script(source)
    return await script(keys=keys, args=args)
