"""The per-tenant limits script on a real Redis (``queues.limits``): tokens given back, queued slots freed
at the first token, leases that end by themselves, and the sliding window's retry time."""

from __future__ import annotations

import asyncio

from queues.keys import Keys
from queues.limits import WINDOW_MS, Limits, TenantLimits


async def test_unused_tokens_go_back_and_the_first_token_frees_the_queued_slot(
    prefixed_redis: tuple[object, Keys],
) -> None:
    redis, keys = prefixed_redis
    limits = TenantLimits(redis, keys, lease_ms=60_000)  # type: ignore[arg-type]
    now = 10 * WINDOW_MS + 1_000
    tpm = Limits(tokens_per_minute=100)
    first = await limits.admit("acme", "normal", "r1", tokens=80, limits=tpm, now_ms=now)
    assert first.limit is None
    assert (await limits.admit("acme", "normal", "r2", tokens=50, limits=tpm, now_ms=now)).limit == "tokens_per_minute"
    await limits.ended("acme", "normal", "r1", minute=first.minute, unused_tokens=60)  # it used 20
    assert (await limits.admit("acme", "normal", "r2", tokens=50, limits=tpm, now_ms=now)).limit is None
    queued = Limits(queued_per_tier=1)
    assert (await limits.admit("acme", "realtime", "q1", tokens=1, limits=queued, now_ms=now)).limit is None
    assert (
        await limits.admit("acme", "realtime", "q2", tokens=1, limits=queued, now_ms=now)
    ).limit == "queued_requests"
    # Per tier (r2 above waits in normal: it counts there).
    assert (await limits.admit("acme", "background", "q3", tokens=1, limits=queued, now_ms=now)).limit is None
    await limits.started("acme", "realtime", "q1")
    assert (await limits.admit("acme", "realtime", "q2", tokens=1, limits=queued, now_ms=now)).limit is None


async def test_a_lease_left_by_a_dead_process_ends_by_itself(prefixed_redis: tuple[object, Keys]) -> None:
    redis, keys = prefixed_redis
    limits = TenantLimits(redis, keys, lease_ms=200)  # type: ignore[arg-type]
    one = Limits(concurrent_requests=1)
    now = 20 * WINDOW_MS
    assert (await limits.admit("acme", "normal", "a", tokens=1, limits=one, now_ms=now)).limit is None
    assert (await limits.admit("acme", "normal", "b", tokens=1, limits=one, now_ms=now + 100)).limit is not None
    await asyncio.sleep(0)
    assert (await limits.admit("acme", "normal", "b", tokens=1, limits=one, now_ms=now + 300)).limit is None


async def test_the_window_slides_and_the_retry_time_says_when_there_is_room(
    prefixed_redis: tuple[object, Keys],
) -> None:
    redis, keys = prefixed_redis
    limits = TenantLimits(redis, keys, lease_ms=60_000)  # type: ignore[arg-type]
    rpm = Limits(requests_per_minute=10)
    start = 30 * WINDOW_MS  # the start of a minute
    for index in range(10):
        assert (await limits.admit("acme", "normal", f"r{index}", tokens=1, limits=rpm, now_ms=start)).limit is None
    full = await limits.admit("acme", "normal", "x", tokens=1, limits=rpm, now_ms=start + 30_000)
    # This minute is full: room comes when it ends, 30 s later.
    assert full.limit == "requests_per_minute" and full.retry_after_ms == 30_000
    # A quarter into the next minute, three quarters of the last one's 10 still count: 7.5 + 1 <= 10.
    assert (
        await limits.admit("acme", "normal", "y", tokens=1, limits=rpm, now_ms=start + WINDOW_MS + 15_000)
    ).limit is None
    # 1 (y) + 7.5 + 1 = 9.5: one more fits; then 2 + 7.5 + 1 > 10, and the next waits for the decay.
    assert (
        await limits.admit("acme", "normal", "z", tokens=1, limits=rpm, now_ms=start + WINDOW_MS + 15_000)
    ).limit is None
    late = await limits.admit("acme", "normal", "w", tokens=1, limits=rpm, now_ms=start + WINDOW_MS + 15_000)
    # 2 this minute + 10 x 0.75 = 9.5; one more needs the last minute's share at <= 7, i.e. 0.7: 3 s later.
    assert late.limit == "requests_per_minute" and late.retry_after_ms == 3_000
    assert (
        await limits.admit("acme", "normal", "w", tokens=1, limits=rpm, now_ms=start + WINDOW_MS + 18_000)
    ).limit is None
