"""The live status page: ``GET /status`` (one HTML file, no build step, no CDN) and the figures it shows,
``GET /status/data``.

Per tier: requests finished, P99 time to first token and to the whole reply, and the SLO attainment over
the last ``TAILCUT_STATUS_WINDOW_S``. They are computed from this API's own Prometheus samples (pooled
over every API process of the host in the multiprocess mode), as Prometheus would compute
``histogram_quantile(0.99, increase(...[window]))``: a snapshot of the cumulative counts is taken every
``SNAPSHOT_S``, and the figures are the counts now less those of the oldest snapshot in the window, so
a P99 is interpolated within the histogram's buckets (``api.metrics.LATENCY_BUCKETS_S``) the way
Prometheus does. Queue depths and queued tokens are the backlog probe's; breakers and workers are read
from Redis at each call, so every API instance shows the same ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from queues.keys import Keys, Tier

SNAPSHOT_S = 10.0
# Latency histograms the page reads, by the name it gives them.
LATENCIES = {"ttft": "tailcut_ttft_seconds_bucket", "e2e": "tailcut_e2e_seconds_bucket"}
SLO_SAMPLE = "tailcut_slo_requests_total"


@dataclass
class Totals:
    """Cumulative counts at one moment: per (latency, tier), each bucket's count by its upper bound;
    per (tier, result), the requests that met or missed their SLO."""

    at: float
    buckets: dict[tuple[str, str], dict[float, float]] = field(default_factory=lambda: defaultdict(dict))
    slo: dict[tuple[str, str], float] = field(default_factory=dict)
    open_streams: float = 0.0

    def minus(self, earlier: Totals) -> Totals:
        delta = Totals(self.at)
        for key, counts in self.buckets.items():
            before = earlier.buckets.get(key, {})
            delta.buckets[key] = {le: count - before.get(le, 0.0) for le, count in counts.items()}
        delta.slo = {key: value - earlier.slo.get(key, 0.0) for key, value in self.slo.items()}
        delta.open_streams = self.open_streams
        return delta


def read_totals(registry: CollectorRegistry, at: float) -> Totals:
    totals = Totals(at)
    kinds = {sample: kind for kind, sample in LATENCIES.items()}
    for family in registry.collect():
        for sample in family.samples:
            kind = kinds.get(sample.name)
            if kind is not None:
                counts = totals.buckets[kind, sample.labels["tier"]]
                le = float(sample.labels["le"])
                # Summed over the length buckets (and over processes, which the collector has done).
                counts[le] = counts.get(le, 0.0) + sample.value
            elif sample.name == SLO_SAMPLE:
                key = (sample.labels["tier"], sample.labels["result"])
                totals.slo[key] = totals.slo.get(key, 0.0) + sample.value
            elif sample.name == "tailcut_open_streams":
                totals.open_streams += sample.value
    return totals


def histogram_quantile(q: float, counts: dict[float, float]) -> float | None:
    """Prometheus's ``histogram_quantile`` over cumulative bucket counts keyed by upper bound (with
    ``+Inf``): linear interpolation inside the bucket that holds the rank; None without observations."""
    bounds = sorted(counts)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    total = counts[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    for index, bound in enumerate(bounds):
        if counts[bound] >= rank:
            if math.isinf(bound):
                return bounds[-2] if len(bounds) > 1 else None
            lower = bounds[index - 1] if index > 0 else 0.0
            below = counts[bounds[index - 1]] if index > 0 else 0.0
            if index == 0 and bound <= 0:
                return bound
            return lower + (bound - lower) * (rank - below) / (counts[bound] - below)
    return None


class StatusWindow:
    """Snapshots of the cumulative counts over the last ``window_s`` (the first is taken at start)."""

    def __init__(self, registry: CollectorRegistry, *, window_s: float, interval_s: float = SNAPSHOT_S) -> None:
        self._registry = registry
        self.window_s = window_s
        self._interval_s = interval_s
        self._snapshots: deque[Totals] = deque()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._snapshots.append(read_totals(self._registry, time.monotonic()))
        self._task = asyncio.create_task(self._run(), name="status-window")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            now = time.monotonic()
            self._snapshots.append(read_totals(self._registry, now))
            # Keep one snapshot older than the window's start: the baseline until the next one is due.
            while len(self._snapshots) > 1 and self._snapshots[1].at <= now - self.window_s:
                self._snapshots.popleft()

    def figures(self) -> tuple[Totals, float]:
        """Counts within the window, and how many seconds it covers."""
        now = time.monotonic()
        current = read_totals(self._registry, now)
        if not self._snapshots:
            return current, 0.0
        baseline = next(
            (snapshot for snapshot in self._snapshots if snapshot.at >= now - self.window_s), self._snapshots[-1]
        )
        return current.minus(baseline), now - baseline.at


def tier_figures(window: Totals, tier: Tier) -> dict[str, Any]:
    met = window.slo.get((tier, "met"), 0.0)
    missed = window.slo.get((tier, "missed"), 0.0)
    figures: dict[str, Any] = {"met": int(met), "missed": int(missed)}
    figures["attainment"] = met / (met + missed) if met + missed else None
    for kind in LATENCIES:
        counts = window.buckets.get((kind, tier), {})
        p99 = histogram_quantile(0.99, counts)
        figures[f"{kind}_p99_ms"] = None if p99 is None else round(p99 * 1000, 1)
        figures[f"{kind}_count"] = int(counts.get(math.inf, 0.0))
    return figures


async def live_workers(redis: aioredis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """Every worker whose beat vouches for it now, with what its last beat said about it."""
    ids = [member.decode() for member in await redis.zrangebyscore(keys.workers, time.time(), "+inf")]
    async with redis.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.hgetall(keys.worker_info(worker_id))
        infos: Iterable[dict[bytes, bytes]] = await pipe.execute()
    workers = []
    for worker_id, info in zip(ids, infos, strict=True):
        fields = {key.decode(): value.decode() for key, value in info.items()}
        for name in (
            "running",
            "waiting",
            "token_budget",
            "prefill_chunk",
            "kv_capacity_tokens",
            "beat_ms",
            "warmup_stage",
        ):
            if name in fields:
                fields[name] = int(fields[name])  # type: ignore[assignment]
        if "capacity" in fields:
            fields["capacity"] = float(fields["capacity"])  # type: ignore[assignment]
        workers.append({"id": worker_id, **fields})
    return sorted(workers, key=lambda worker: worker["id"])
