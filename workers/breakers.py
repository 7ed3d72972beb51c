"""Tiered circuit breakers on finished-request latency, one per SLO tier, shared by every worker in Redis.

- **Tier 0, realtime** (closed / open / half-open): ``realtime_trip_count`` consecutive realtime
  requests with an end-to-end latency over ``realtime_over_ms`` open it. While open the service is in
  degrade mode: new realtime replies are capped at ``realtime_cap_tokens`` (marked
  ``{"degraded": "capped", "reason": "breaker"}``) and no background request is admitted. After
  ``realtime_open_s`` it is half-open: normal service again (background included: recovery must not
  wait for realtime traffic that may not come), on probation; ``realtime_close_after`` good
  realtime requests in a row close it, one more slow one opens it again.
- **Tier 1, normal**: the P99 time to first token of normal requests over a sliding window
  (``normal_window_s``, 5 min) above ``normal_p99_ms`` opens it: a scale-up signal — an event on
  ``tc:events``, the state an autoscaler reads (``tailcut_breaker_state``, ``/readyz``), and an
  optional webhook. It closes when the P99 is back under the threshold. Time to first token, not end
  to end: a normal reply's length decides its end, the capacity a scale-up adds decides its start.
- **Tier 2, background**: the same window rule on background time to first token, log only.

Latencies are measured by the worker that finished the request, from its enqueue time (as the
client's clock would, less the network). The consecutive rule runs in one Lua script per realtime
finish, so concurrent workers trip it exactly once; the window rules run every
``evaluate_interval_s`` on one worker (a lock), for all, over the samples each worker writes once a
second (buffered: one round trip a second instead of one per finished request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from queues import scripts
from queues.breakers import BreakerView, read_breakers
from queues.keys import Keys, Tier
from tailcut.logs import log_event

log = logging.getLogger("tailcut.breakers")

EventSink = Callable[..., Awaitable[None]]
# Most samples a window keeps (the newest).
WINDOW_SAMPLES_KEPT = 20_000
# A worker writes its buffered window samples at least once a second, and at once past this many.
SAMPLES_BUFFERED = 1000
# How long a closing handle may try to write its buffered samples (Redis may be gone).
CLOSE_FLUSH_S = 2.0

# KEYS: breaker hash, recent list. ARGV: latency_ms, now_ms, over_ms, trip_count, open_ms, close_after.
# Returns the new state when it changed, else false.
RECORD_REALTIME = """
local lat, now = tonumber(ARGV[1]), tonumber(ARGV[2])
local over, trip, open_ms, close_after = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local state = redis.call('HGET', KEYS[1], 'state') or 'closed'
local since = tonumber(redis.call('HGET', KEYS[1], 'since_ms') or '0')
local changed = false
if state == 'open' and now - since >= open_ms then
  state = 'half_open'
  redis.call('HSET', KEYS[1], 'state', state, 'since_ms', now, 'good', 0, 'reason', 'on probation')
  changed = state
end
redis.call('LPUSH', KEYS[2], lat)
redis.call('LTRIM', KEYS[2], 0, trip - 1)
if state == 'closed' then
  local recent = redis.call('LRANGE', KEYS[2], 0, -1)
  if #recent < trip then return changed end
  for _, value in ipairs(recent) do
    if tonumber(value) <= over then return changed end
  end
  redis.call('HSET', KEYS[1], 'state', 'open', 'since_ms', now,
    'reason', trip .. ' realtime requests in a row over ' .. over .. ' ms')
  return 'open'
elseif state == 'half_open' then
  if lat > over then
    redis.call('HSET', KEYS[1], 'state', 'open', 'since_ms', now,
      'reason', 'a realtime request over ' .. over .. ' ms on probation')
    return 'open'
  end
  if redis.call('HINCRBY', KEYS[1], 'good', 1) >= close_after then
    redis.call('HSET', KEYS[1], 'state', 'closed', 'since_ms', now, 'reason', 'recovered')
    redis.call('DEL', KEYS[2])
    return 'closed'
  end
end
return changed
"""

# KEYS: breaker hash. ARGV: now_ms, open_ms. An open breaker whose time is up becomes half-open.
PROBATION = """
local state = redis.call('HGET', KEYS[1], 'state')
local since = tonumber(redis.call('HGET', KEYS[1], 'since_ms') or '0')
if state == 'open' and tonumber(ARGV[1]) - since >= tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'state', 'half_open', 'since_ms', ARGV[1], 'good', 0, 'reason', 'on probation')
  return 1
end
return 0
"""


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    realtime_over_ms: int = 800
    realtime_trip_count: int = 3
    realtime_open_s: float = 30.0
    realtime_close_after: int = 3
    realtime_cap_tokens: int = 128
    normal_p99_ms: int = 1500
    normal_window_s: float = 300.0
    background_p99_ms: int = 60_000
    background_window_s: float = 300.0
    # A window rule judges only with at least this many samples in the window.
    min_samples: int = 20
    evaluate_interval_s: float = 5.0
    # POSTed on every tier-1 change (JSON: event, tier, p99_ms, samples, at_ms); none when empty.
    webhook_url: str = ""
    webhook_timeout_s: float = 2.0
    webhook_attempts: int = 3


def p99(values: list[float]) -> float:
    """The 99th percentile, nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class Breakers:
    """One worker's handle on the shared breakers; ``events(kind, **fields)`` writes ``tc:events``."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, config: BreakerConfig, *, events: EventSink) -> None:
        self._redis = redis
        self._keys = keys
        self.config = config
        self._events = events
        self.views: dict[Tier, BreakerView] = {}
        # Webhook calls go out one at a time, in order (a retried signal never overtakes the next).
        self._outbox: asyncio.Queue[dict[str, str | int]] = asyncio.Queue()
        self._sender: asyncio.Task[None] | None = None
        # Window samples (tier 1 and 2) not written yet: per tier, "request id:TTFT ms" → finish time.
        self._samples: dict[Tier, dict[str, int]] = {}

    @property
    def degrade_mode(self) -> bool:
        """Tier 0 is not closed: realtime replies are capped, background waits."""
        view = self.views.get("realtime")
        return view is not None and view.state == "open"

    @property
    def admits_background(self) -> bool:
        """Background waits only while tier 0 is open, never longer than ``realtime_open_s`` at a time."""
        return not self.degrade_mode

    async def record(self, tier: Tier, *, ttft_ms: int | None, e2e_ms: int, request_id: str, now_ms: int) -> None:
        """One finished request of ``tier``."""
        config = self.config
        if tier == "realtime":
            changed = await scripts.run(
                self._redis,
                RECORD_REALTIME,
                [self._keys.breaker(tier), self._keys.recent_latencies(tier)],
                [
                    e2e_ms,
                    now_ms,
                    config.realtime_over_ms,
                    config.realtime_trip_count,
                    int(config.realtime_open_s * 1000),
                    config.realtime_close_after,
                ],
            )
            if changed:
                state = changed.decode() if isinstance(changed, bytes) else str(changed)
                await self._events(f"breaker_{state}", tier=tier, breaker=0, latency_ms=e2e_ms, rid=request_id)
                log_event(log, f"breaker_{state}", logging.WARNING, tier=tier, latency_ms=e2e_ms)
            return
        if ttft_ms is None:
            return
        # Buffered: the window rules judge minutes of samples every few seconds, so one round trip a
        # second (``flush_samples``, from the worker's breaker loop and ``evaluate``) carries them all.
        window = self._samples.setdefault(tier, {})
        window[f"{request_id}:{ttft_ms}"] = now_ms
        if len(window) >= SAMPLES_BUFFERED:
            await self.flush_samples()

    async def flush_samples(self) -> None:
        """Write the window samples recorded since the last flush, in one round trip; kept for the next
        flush when Redis does not take them (the newest ``WINDOW_SAMPLES_KEPT`` of each tier)."""
        if not self._samples:
            return
        samples, self._samples = self._samples, {}
        ttl_s = int(max(self.config.normal_window_s, self.config.background_window_s)) + 60
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for tier, window in samples.items():
                    key = self._keys.latency_window(tier)
                    pipe.zadd(key, window)
                    pipe.zremrangebyrank(key, 0, -WINDOW_SAMPLES_KEPT - 1)
                    pipe.expire(key, ttl_s)
                await pipe.execute()
        except BaseException:
            for tier, window in samples.items():
                kept = {**window, **self._samples.get(tier, {})}
                self._samples[tier] = dict(list(kept.items())[-WINDOW_SAMPLES_KEPT:])
            raise

    async def evaluate(self, now_ms: int) -> None:
        """The time-driven rules, once per interval across all workers: tier 0's probation, tier 1
        and tier 2's windows."""
        await self.flush_samples()
        interval_ms = int(self.config.evaluate_interval_s * 1000)
        if not await self._redis.set(self._keys.breaker_evaluation, b"1", nx=True, px=max(1, interval_ms - 50)):
            return
        await self.evaluate_now(now_ms)

    async def evaluate_now(self, now_ms: int) -> None:
        await self.flush_samples()
        config = self.config
        moved = await scripts.run(
            self._redis, PROBATION, [self._keys.breaker("realtime")], [now_ms, int(config.realtime_open_s * 1000)]
        )
        if moved:
            await self._events("breaker_half_open", tier="realtime", breaker=0)
        await self._window("normal", now_ms, config.normal_p99_ms, config.normal_window_s, "scale_up")
        await self._window("background", now_ms, config.background_p99_ms, config.background_window_s, "slow")

    async def _window(self, tier: Tier, now_ms: int, threshold_ms: int, window_s: float, signal: str) -> None:
        key = self._keys.latency_window(tier)
        await self._redis.zremrangebyscore(key, "-inf", now_ms - window_s * 1000)
        members = await self._redis.zrange(key, 0, -1)
        values = [float(member.rsplit(b":", 1)[1]) for member in members]
        current = (await read_breakers(self._redis, self._keys))[tier].state
        tail = p99(values) if values else 0.0
        if len(values) >= self.config.min_samples and tail > threshold_ms and current != "open":
            reason = f"P99 time to first token {tail:.0f} ms over {threshold_ms} ms in {window_s:.0f} s"
            await self._set(tier, "open", now_ms, reason)
            await self._signal(f"{tier}_{signal}", tier, tail, len(values), now_ms)
        elif current == "open" and tail <= threshold_ms:
            await self._set(tier, "closed", now_ms, "recovered")
            await self._signal(f"{tier}_{signal}_cleared", tier, tail, len(values), now_ms)

    async def _set(self, tier: Tier, state: str, now_ms: int, reason: str) -> None:
        mapping: dict[str | bytes, str | int] = {"state": state, "since_ms": now_ms, "reason": reason}
        await cast(Awaitable[int], self._redis.hset(self._keys.breaker(tier), mapping=mapping))

    async def _signal(self, kind: str, tier: Tier, tail_ms: float, samples: int, now_ms: int) -> None:
        await self._events(kind, tier=tier, p99_ms=int(tail_ms), samples=samples)
        level = logging.WARNING if not kind.endswith("_cleared") else logging.INFO
        log_event(log, kind, level, tier=tier, p99_ms=int(tail_ms), samples=samples)
        if tier == "normal" and self.config.webhook_url:
            body: dict[str, str | int] = {
                "event": kind,
                "tier": tier,
                "p99_ms": int(tail_ms),
                "samples": samples,
                "at_ms": now_ms,
            }
            self._outbox.put_nowait(body)
            if self._sender is None or self._sender.done():
                self._sender = asyncio.create_task(self._send_webhooks(), name="breaker-webhook")

    async def _send_webhooks(self) -> None:
        while not self._outbox.empty():
            await self._post_webhook(self._outbox.get_nowait())

    async def _post_webhook(self, body: dict[str, str | int]) -> None:
        """POST the signal, retrying with backoff; a webhook that never answers is logged, not fatal."""
        data = orjson.dumps(body)
        for attempt in range(1, self.config.webhook_attempts + 1):
            try:
                await asyncio.to_thread(self._post, data)
                return
            except OSError as exc:
                log_event(log, "webhook_failed", logging.WARNING, attempt=attempt, error=str(exc))
                await asyncio.sleep(0.5 * 2 ** (attempt - 1))

    def _post(self, data: bytes) -> None:
        request = urllib.request.Request(
            self.config.webhook_url, data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=self.config.webhook_timeout_s) as response:
            response.read()

    async def refresh(self) -> dict[Tier, BreakerView]:
        self.views = await read_breakers(self._redis, self._keys)
        return self.views

    async def close(self) -> None:
        """Write the buffered window samples (best effort) and let the pending webhook calls go out
        (bounded by their timeouts and retries)."""
        with contextlib.suppress(RedisError, TimeoutError):
            async with asyncio.timeout(CLOSE_FLUSH_S):
                await self.flush_samples()
        if self._sender is not None and not self._sender.done():
            limit_s = (self.config.webhook_timeout_s + 2) * self.config.webhook_attempts * (1 + self._outbox.qsize())
            await asyncio.wait([self._sender], timeout=limit_s)
