"""Per-tenant limits, enforced in Redis by one Lua script per request, so every API process shares them.

A tenant (its API key's, ``queues.apikeys``) may have, each 0 for none:

- **requests per minute** and **tokens per minute**: a sliding window over two fixed minute windows
  (``tc:lim:{tenant}:r:{minute}``, ``...:t:{minute}``): the count now is this minute's plus the last
  minute's weighted by the share of it still inside the window. Tokens are the prompt plus
  ``max_tokens``, reserved at admission; when the reply ends, what it did not use is given back to the
  minute it was charged to (``settle``);
- **concurrent requests** (``tc:lim:{tenant}:s``): requests being answered, each a member of a sorted set
  scored by the time its lease ends (``lease_ms``), removed when its reply ends; a lease left by a
  process that died ends by itself;
- **queued requests per tier** (``tc:lim:{tenant}:q:{tier}``): requests accepted that have not produced
  their first token yet, the same way.

A refusal names the limit and when to retry: for a rate, when the window will have room for this
request (at least 1 s); for the concurrent and queued limits, 1 s.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from queues import scripts
from queues.keys import Keys

WINDOW_MS = 60_000

# KEYS: requests now, requests last minute, tokens now, tokens last minute, concurrent set, queued set.
# ARGV: now (ms), ms into this minute, window (ms), rpm, tpm, tokens, max concurrent, max queued, request id,
# lease (ms). Returns {'ok'} | {limit, retry after (ms)} | {'too_large'}.
ADMIT = """
local now, elapsed, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local rpm, tpm, tokens = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local max_concurrent, max_queued, lease = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[10])
local share = (window - elapsed) / window
local function wait_for(limit, current_key, previous_key, need)
  local current = tonumber(redis.call('GET', current_key) or '0')
  local previous = tonumber(redis.call('GET', previous_key) or '0')
  if current + previous * share + need <= limit then return nil end
  if current + need > limit or previous == 0 then return window - elapsed end
  -- The last minute's share decays linearly until this minute ends: when is there room?
  local room = limit - current - need
  return math.max(0, (window - elapsed) - room * window / previous)
end
if tpm > 0 and tokens > tpm then return {'too_large'} end
if rpm > 0 then
  local wait = wait_for(rpm, KEYS[1], KEYS[2], 1)
  if wait then return {'requests_per_minute', math.ceil(wait)} end
end
if tpm > 0 then
  local wait = wait_for(tpm, KEYS[3], KEYS[4], tokens)
  if wait then return {'tokens_per_minute', math.ceil(wait)} end
end
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
if max_concurrent > 0 and redis.call('ZCARD', KEYS[5]) >= max_concurrent then return {'concurrent_requests', 1000} end
if max_queued > 0 and redis.call('ZCARD', KEYS[6]) >= max_queued then return {'queued_requests', 1000} end
redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], 2 * window)
redis.call('INCRBY', KEYS[3], tokens)
redis.call('PEXPIRE', KEYS[3], 2 * window)
redis.call('ZADD', KEYS[5], now + lease, ARGV[9])
redis.call('PEXPIRE', KEYS[5], lease)
redis.call('ZADD', KEYS[6], now + lease, ARGV[9])
redis.call('PEXPIRE', KEYS[6], lease)
return {'ok'}
"""

# KEYS: concurrent set, queued set, the tokens of the minute it was charged to. ARGV: request id, unused
# tokens. A minute already expired is left alone (no negative key without a TTL).
RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if tonumber(ARGV[2]) > 0 and redis.call('EXISTS', KEYS[3]) == 1 then redis.call('DECRBY', KEYS[3], ARGV[2]) end
return 1
"""


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's limits; 0: none."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    concurrent_requests: int = 0
    queued_per_tier: int = 0

    @property
    def any(self) -> bool:
        return any((self.requests_per_minute, self.tokens_per_minute, self.concurrent_requests, self.queued_per_tier))


@dataclass(frozen=True, slots=True)
class Admission:
    """What the check decided: ``limit`` is None when admitted; else the limit hit and when to retry."""

    limit: str | None
    retry_after_ms: int = 0
    minute: int = 0  # the minute the tokens were charged to (for ``settle``)


class TenantLimits:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, lease_ms: int) -> None:
        self._redis = redis
        self._keys = keys
        self._lease_ms = lease_ms

    async def admit(
        self, tenant: str, tier: str, request_id: str, *, tokens: int, limits: Limits, now_ms: int
    ) -> Admission:
        keys = self._keys
        minute, elapsed = divmod(now_ms, WINDOW_MS)
        reply = await scripts.run(
            self._redis,
            ADMIT,
            [
                keys.limit_requests(tenant, minute),
                keys.limit_requests(tenant, minute - 1),
                keys.limit_tokens(tenant, minute),
                keys.limit_tokens(tenant, minute - 1),
                keys.limit_concurrent(tenant),
                keys.limit_queued(tenant, tier),
            ],
            [
                now_ms,
                elapsed,
                WINDOW_MS,
                limits.requests_per_minute,
                limits.tokens_per_minute,
                tokens,
                limits.concurrent_requests,
                limits.queued_per_tier,
                request_id,
                self._lease_ms,
            ],
        )
        verdict = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        if verdict == "ok":
            return Admission(None, minute=minute)
        return Admission(verdict, retry_after_ms=int(reply[1]) if len(reply) > 1 else 0)

    async def started(self, tenant: str, tier: str, request_id: str) -> None:
        """Its first token came: it no longer counts as queued."""
        await self._redis.zrem(self._keys.limit_queued(tenant, tier), request_id)

    async def ended(self, tenant: str, tier: str, request_id: str, *, minute: int, unused_tokens: int) -> None:
        """Its reply ended: it no longer counts as running, and its unused tokens go back to its minute."""
        keys = self._keys
        await scripts.run(
            self._redis,
            RELEASE,
            [keys.limit_concurrent(tenant), keys.limit_queued(tenant, tier), keys.limit_tokens(tenant, minute)],
            [request_id, max(0, unused_tokens)],
        )
