"""The shared state of the tiered circuit breakers (``tc:breaker:{tier}``): what workers write and the
API reads. The rules that move it live with the workers (``workers.breakers``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis

from queues.keys import TIERS, Keys, Tier

BreakerState = Literal["closed", "open", "half_open"]
# Gauge values of the states (tailcut_breaker_state).
STATE_VALUES: dict[BreakerState, int] = {"closed": 0, "half_open": 1, "open": 2}


@dataclass(frozen=True, slots=True)
class BreakerView:
    tier: Tier
    state: BreakerState = "closed"
    since_ms: int = 0
    reason: str = ""

    def as_dict(self) -> dict[str, str | int]:
        return {"state": self.state, "since_ms": self.since_ms, "reason": self.reason}


async def read_breakers(redis: aioredis.Redis, keys: Keys) -> dict[Tier, BreakerView]:
    """Every tier's breaker (closed when never tripped)."""
    async with redis.pipeline(transaction=False) as pipe:
        for tier in TIERS:
            pipe.hgetall(keys.breaker(tier))
        replies = await pipe.execute()
    views: dict[Tier, BreakerView] = {}
    for tier, raw in zip(TIERS, replies, strict=True):
        fields = {key.decode(): value.decode() for key, value in (raw or {}).items()}
        state = fields.get("state", "closed")
        views[tier] = BreakerView(
            tier,
            state if state in STATE_VALUES else "closed",
            int(fields.get("since_ms", 0) or 0),
            fields.get("reason", ""),
        )
    return views


async def reset_breaker(redis: aioredis.Redis, keys: Keys, tier: Tier, *, now_ms: int, reason: str) -> BreakerView:
    """Close ``tier``'s breaker for every worker (each reads it within a second) and forget the latencies
    its rules judged, so they judge afresh from the next finished request; returns the state before."""
    view = (await read_breakers(redis, keys))[tier]
    mapping: dict[str | bytes, str | int] = {"state": "closed", "since_ms": now_ms, "reason": reason, "good": 0}
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.breaker(tier), mapping=mapping)
        pipe.delete(keys.recent_latencies(tier), keys.latency_window(tier))
        await pipe.execute()
    return view
