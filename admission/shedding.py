"""Load shedding at admission: past its tier's queue limit, a new request gets HTTP 429 at once.

Under overload a queue that only grows serves nobody well: every request in it waits longer than the
one before, and the realtime tier's deadline passes while it queues. So each tier has a bound on the
requests waiting for a worker, and a request arriving past it is refused with ``Retry-After``. The
bounds are smallest for background and largest for realtime, so overload sheds background first; the
engine's time goes to the tiers whose SLOs can still be met. The rule is applied by
``admission.admitter.Admitter`` against a ``QueueDepth``: the API's is ``Backlog`` below, the
simulator's counts its own queue, so ``tailcut bench policies`` measures what this does at 120% load.

"Waiting" is the intake streams' lag (entries no worker has read yet), polled every
``shed_probe_interval_s``, plus the requests this process admitted since the last poll, so a burst
between two polls cannot run past the bound. While every stream is empty and this process admits
nothing, the poll comes once a second instead (``IDLE_PROBE_S``), and one interval after the next admission:
an idle API does not send Redis ten probes a second, and a burst other API processes send while this
one is idle is seen up to a second late here. An admission whose XADD and the poll cross each other is
counted once: the poll also says up to which entry id its count goes (``intake.lags``), and the
admission knows its entry's id. Requests a worker has read ahead into its local queue
(at most ``TAILCUT_SCHEDULER__PREFETCH`` per tier) are not counted. The bound is on requests, not on
queued tokens (DESIGN.md names both): a count bounds the wait well enough when the tier's lengths are
bounded, as the length buckets keep them. The queued tokens are measured too (each entry carries its
cost; ``intake.queued_tokens``), about once a second, for the metrics and the status page.

``Retry-After`` is how long the workers take, at the tier's recent drain rate, to read the requests
that stand between the queue and a free place in it: at least 1 s, at most 30 s.

A tier may also bound its wait (``ShedLimits.normal_wait_ms`` and the others; off by default): a
request is refused while the tier's oldest waiting request has waited that long. The same poll reads
it in Redis's own clock — the oldest entry no worker has read, whose id XADD stamped, against the
server's TIME — and adds this host's time since the poll, so no clock of this host is compared with
Redis's. ``Retry-After`` is then how far the oldest is past the bound (at least 1 s, at most 30 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from queues import intake
from queues.intake import EntryKey, entry_key
from queues.keys import BUCKETS, TIERS, Bucket, Keys, Tier
from tailcut.logs import log_event

log = logging.getLogger("tailcut.admission")

RETRY_AFTER_MAX_S = 30
# The queued tokens (a metric, not a shedding input) are summed at most this often: it reads the entries.
QUEUED_TOKENS_INTERVAL_S = 1.0
# While the intake streams are empty and this process admits nothing, the backlog is probed this seldom
# (instead of every ``shed_probe_interval_s``), and again one interval after the next admission.
IDLE_PROBE_S = 1.0
# Weight of the newest probe in the drain-rate average (about the last two seconds at 10 probes/s).
DRAIN_SMOOTHING = 0.05


@dataclass(frozen=True, slots=True)
class ShedLimits:
    """Most requests of each tier that may wait, and (``*_wait_ms``) the longest the oldest of them may
    have waited; 0 turns either bound off for the tier.

    The count bounds the queue; the wait bounds what it costs the requests in it, which the count does
    only as well as the tier's lengths and the engine's speed let it: 256 documents behind a busy
    realtime tier wait seconds on a GPU, and on a CPU engine a few requests do. So the wait bounds are
    off by default — a closed-loop client (``vllm bench serve --max-concurrency 64``) against a slow
    engine queues for seconds and should not be refused for it — and an operator who holds a tier to a
    latency target sets one: a request that would start later than that is refused at once, with
    ``Retry-After``, rather than queued to miss its target by seconds (BENCHMARKS.md "A workload with
    no background tier": the normal tier's bound at twice its TTFT target).
    """

    realtime: int = 512
    normal: int = 256
    background: int = 192
    realtime_wait_ms: int = 0
    normal_wait_ms: int = 0
    background_wait_ms: int = 0

    def limit(self, tier: Tier) -> int:
        limits: dict[Tier, int] = {"realtime": self.realtime, "normal": self.normal, "background": self.background}
        return limits[tier]

    def wait_limit_ms(self, tier: Tier) -> int:
        limits: dict[Tier, int] = {
            "realtime": self.realtime_wait_ms,
            "normal": self.normal_wait_ms,
            "background": self.background_wait_ms,
        }
        return limits[tier]

    @classmethod
    def never(cls) -> ShedLimits:
        """No tier is ever shed (the baselines: a plain engine server queues everything)."""
        return cls(realtime=0, normal=0, background=0, realtime_wait_ms=0, normal_wait_ms=0, background_wait_ms=0)

    def sheds(self, tier: Tier, num_waiting: int) -> bool:
        limit = self.limit(tier)
        return limit > 0 and num_waiting >= limit


class QueueDepth(Protocol):
    """What the shedding rule reads: requests of a tier waiting now, how long the oldest of them has
    waited, and when to come back."""

    def waiting(self, tier: Tier) -> int: ...

    def oldest_wait_ms(self, tier: Tier) -> float: ...

    def retry_after_s(self, tier: Tier, limit: int) -> int: ...


class Backlog:
    """Requests waiting per tier in the intake streams, as the shedding rule reads them (see the
    module docstring). Reads Redis, never writes it."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, interval_s: float, idle_s: float = IDLE_PROBE_S) -> None:
        self._redis = redis
        self._streams = {tier: [keys.intake(tier, bucket) for bucket in BUCKETS] for tier in TIERS}
        self._keys_of = {keys.intake(tier, bucket): (tier, bucket) for tier in TIERS for bucket in BUCKETS}
        self._interval_s = interval_s
        self._idle_s = max(interval_s, idle_s)
        self._probed: dict[Tier, int] = dict.fromkeys(TIERS, 0)
        # The last probe per (tier, bucket): entries no worker has read yet.
        self.depth: dict[tuple[Tier, Bucket], int] = {(tier, bucket): 0 for tier in TIERS for bucket in BUCKETS}
        # The tokens those entries will cost the engine (``intake.queued_tokens``), summed about once a second.
        self.tokens: dict[tuple[Tier, Bucket], int] = dict.fromkeys(self.depth, 0)
        self._tokens_at: float | None = None
        # Per stream: the last probe counted every entry up to this id; this process's admissions after it.
        self._upto: dict[str, EntryKey] = dict.fromkeys(self._keys_of, (0, 0))
        self._unprobed: dict[str, list[EntryKey]] = {stream: [] for stream in self._keys_of}
        self._admitted: dict[Tier, int] = dict.fromkeys(TIERS, 0)
        # Admissions the last probe counted, whose XADD had returned only after it ran.
        self._counted_late: dict[Tier, int] = dict.fromkeys(TIERS, 0)
        # Requests per second the workers read from each tier's streams (smoothed).
        self._drain_rps: dict[Tier, float] = dict.fromkeys(TIERS, 0.0)
        # The last probe per tier: how long its oldest waiting entry had waited (``intake.Lag``).
        self._oldest_ms: dict[Tier, int] = dict.fromkeys(TIERS, 0)
        self._probed_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._admission = asyncio.Event()  # this process admitted a request: an idle wait ends

    def waiting(self, tier: Tier) -> int:
        """The last probe, plus what this process admitted since, minus what the workers read since at
        their recent rate (without it, a busy API would count requests already running)."""
        since_s = time.monotonic() - self._probed_at if self._probed_at is not None else 0.0
        drained = int(self._drain_rps[tier] * since_s)
        return max(self._probed[tier], self._probed[tier] + self._admitted[tier] - drained)

    def oldest_wait_ms(self, tier: Tier) -> float:
        """How long the tier's oldest waiting entry has waited: at the last probe, in Redis's clock
        (``intake.Lag.oldest_wait_ms``), and since then by this host's; 0 while none waited then."""
        waited_ms = self._oldest_ms[tier]
        if not waited_ms or self._probed_at is None:
            return 0.0
        return waited_ms + (time.monotonic() - self._probed_at) * 1000

    def admitted(self, tier: Tier, bucket: Bucket, entry_id: str) -> None:
        """This process appended ``entry_id`` to the tier's ``bucket`` stream."""
        stream = self._streams[tier][BUCKETS.index(bucket)]
        key = entry_key(entry_id)
        if key <= self._upto[stream]:
            self._counted_late[tier] += 1
        else:
            self._unprobed[stream].append(key)
            self._admitted[tier] += 1
        self._admission.set()

    def retry_after_s(self, tier: Tier, limit: int) -> int:
        """Seconds until the tier's queue has drained below ``limit`` at the recent drain rate."""
        excess = self.waiting(tier) - limit + 1
        rate = self._drain_rps[tier]
        if rate <= 0:
            return RETRY_AFTER_MAX_S
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(excess / rate)))

    async def probe(self) -> None:
        lags = await intake.lags(self._redis, list(self._keys_of))
        now = time.monotonic()
        elapsed = now - self._probed_at if self._probed_at is not None else 0.0
        for tier, streams in self._streams.items():
            counted, later = self._counted_late[tier], 0  # this process's admissions the probe holds, and not
            for bucket, stream in zip(BUCKETS, streams, strict=True):
                lag = lags[stream]
                self.depth[tier, bucket] = lag.waiting
                self._upto[stream] = lag.upto
                unprobed = self._unprobed[stream]
                self._unprobed[stream] = [key for key in unprobed if key > lag.upto]
                counted += len(unprobed) - len(self._unprobed[stream])
                later += len(self._unprobed[stream])
            waiting = sum(self.depth[tier, bucket] for bucket in BUCKETS)
            self._oldest_ms[tier] = max(lags[stream].oldest_wait_ms for stream in streams)
            if elapsed > 0:
                # Read by workers since the last probe: what was there, plus what came, minus what is left.
                drained = max(0, self._probed[tier] + counted - waiting)
                self._drain_rps[tier] += DRAIN_SMOOTHING * (drained / elapsed - self._drain_rps[tier])
            self._probed[tier] = waiting
            self._admitted[tier] = later
            self._counted_late[tier] = 0
        self._probed_at = now
        if self._tokens_at is None or now - self._tokens_at >= QUEUED_TOKENS_INTERVAL_S:
            self._tokens_at = now
            tokens = await intake.queued_tokens(self._redis, list(self._keys_of))
            for stream, key in self._keys_of.items():
                self.tokens[key] = tokens.get(stream, 0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="shed-backlog")

    @property
    def idle(self) -> bool:
        """The last probe found every stream empty and this process admitted nothing since."""
        return not any(self.depth.values()) and not any(self._unprobed.values())

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.probe()
            except RedisError as exc:
                # Keep the last figures; Redis errors reach clients as 503s on enqueue anyway.
                log_event(log, "backlog_probe_failed", logging.WARNING, error=str(exc))
            await self._pause(self._stopping, self._interval_s)
            if self.idle:
                # Nothing queued and nothing admitted here: probe again after ``idle_s``, or one interval
                # after this process admits a request (not beside its intake, on its first token's path;
                # the admission counts itself meanwhile). Other APIs' bursts are seen up to ``idle_s`` late.
                self._admission.clear()
                if await self._pause(self._admission, self._idle_s - self._interval_s):
                    await self._pause(self._stopping, self._interval_s)

    @staticmethod
    async def _pause(event: asyncio.Event, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``event``; whether it came."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await event.wait()
        return event.is_set()
