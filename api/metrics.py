"""Prometheus metrics of one API process (``GET /metrics``), on a registry of its own.

Latencies are measured here from admission (the moment the request is accepted) to the first
content chunk (TTFT) and to the terminal event (E2E), per tier; the output-length predictor's error
is recorded when the real length is known. Each finished request is counted as having met its tier's
SLO targets (``SloTargets``) or missed them: the attainment.

Several API processes on one host (``TAILCUT_API_PROCESSES``) share one exposition through
prometheus-client's multiprocess mode: each process writes its samples to files in
``PROMETHEUS_MULTIPROC_DIR`` and ``exposition()`` reads them all, so any process's ``/metrics`` answers
for the host. What is read from Redis (queue depth and tokens) is the same in every process and is
collected by the answering one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from admission.admitter import Admitter
from admission.shedding import Backlog
from queues.keys import BUCKETS, TIERS, Bucket, Tier
from queues.messages import OutputEvent, RequestMessage

GAP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)
TOKEN_ERROR_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 4096)


# Why a reply is degraded (``workers.lifecycle``): a heartbeat gap (a summary), an open breaker (capped).
DEGRADE_REASONS = ("heartbeat", "breaker")
# Where prometheus-client's multiprocess mode keeps each process's samples (set: the mode is on).
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True, slots=True)
class SloTargets:
    """Each tier's latency targets in seconds (0: none). A request meets its tier's SLO when it ends
    with its full reply within every target; one that ends in an error misses it; one the client
    cancelled is not counted. A degraded reply (a summary) is judged on its latency, and counted in
    ``tailcut_requests_degraded_total`` as well."""

    realtime_ttft_s: float = 0.25
    realtime_e2e_s: float = 1.0
    normal_ttft_s: float = 1.0
    # Time per output token after the first: (E2E - TTFT) / (output tokens - 1).
    normal_tpot_s: float = 0.05
    background_e2e_s: float = 0.0

    def met(self, tier: Tier, *, ttft_s: float | None, e2e_s: float, output_tokens: int) -> bool:
        ttft = ttft_s if ttft_s is not None else e2e_s
        if tier == "realtime":
            return within(ttft, self.realtime_ttft_s) and within(e2e_s, self.realtime_e2e_s)
        if tier == "normal":
            tpot = (e2e_s - ttft) / (output_tokens - 1) if output_tokens > 1 else 0.0
            return within(ttft, self.normal_ttft_s) and within(tpot, self.normal_tpot_s)
        return within(e2e_s, self.background_e2e_s)


def within(value: float, target: float) -> bool:
    return target <= 0 or value <= target


class ApiMetrics:
    def __init__(self, slo: SloTargets | None = None) -> None:
        self.slo = slo or SloTargets()
        self.registry = CollectorRegistry()
        self._collectors: list[Collector] = []
        self._exposed: CollectorRegistry | None = None
        self._series: dict[tuple[Tier, Bucket], Series] = {}
        self.admitted = Counter(
            "tailcut_requests_admitted_total",
            "Requests accepted into the intake streams.",
            ["tier", "bucket"],
            registry=self.registry,
        )
        self.finished = Counter(
            "tailcut_requests_finished_total",
            "Requests that reached a terminal event.",
            ["tier", "outcome"],
            registry=self.registry,
        )
        self.shed = Counter(
            "tailcut_requests_shed_total",
            "Requests refused with 429 because their tier's queue was at its limit.",
            ["tier"],
            registry=self.registry,
        )
        self.not_replicated = Counter(
            "tailcut_requests_not_replicated_total",
            "Requests refused with 503 because no replica confirmed their intake entry in time "
            "(TAILCUT_INTAKE_DURABILITY=replica); each was withdrawn.",
            registry=self.registry,
        )
        self.tenant_limited = Counter(
            "tailcut_tenant_limited_total",
            "Requests refused with 429 because their tenant was at one of its limits (API keys).",
            ["limit"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tailcut_ttft_seconds",
            "Admission to first content chunk.",
            ["tier", "bucket"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "tailcut_e2e_seconds",
            "Admission to terminal event.",
            ["tier", "bucket"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.chunk_gap = Histogram(
            "tailcut_inter_chunk_gap_seconds",
            "Time between two deliveries of content of one reply (chunks that arrive together leave in one "
            "write: one gap).",
            ["tier", "bucket"],
            buckets=GAP_BUCKETS_S,
            registry=self.registry,
        )
        self.prediction_error = Histogram(
            "tailcut_prediction_error_tokens",
            "Absolute error of the output-length prediction made at admission.",
            ["tier"],
            buckets=TOKEN_ERROR_BUCKETS,
            registry=self.registry,
        )
        self.slo_requests = Counter(
            "tailcut_slo_requests_total",
            "Finished requests that met (`result=met`) or missed their tier's SLO targets (TAILCUT_SLO_*); "
            "attainment is met / (met + missed).",
            ["tier", "result"],
            registry=self.registry,
        )
        self.degraded = Counter(
            "tailcut_requests_degraded_total",
            "Requests that finished degraded (a summary instead of the full reply), by reason.",
            ["tier", "reason"],
            registry=self.registry,
        )
        self.breaker_state = Gauge(
            "tailcut_breaker_state",
            "Circuit breaker of each SLO tier: 0 closed, 1 half-open, 2 open (realtime: degrade mode; "
            "normal: scale up; background: slow, logged).",
            ["tier"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.open_streams = Gauge(
            "tailcut_open_streams",
            "Requests the API processes are waiting on.",
            registry=self.registry,
            multiprocess_mode="livesum",
        )

        self._initialise()

    def _initialise(self) -> None:
        """Every tier's and bucket's series from the start, at zero: a rate or a ratio over them is 0, not
        absent (Prometheus cannot tell "none yet" from "not exported")."""
        for limit in ("requests_per_minute", "tokens_per_minute", "concurrent_requests", "queued_requests"):
            self.tenant_limited.labels(limit)
        for tier in TIERS:
            self.shed.labels(tier)
            self.finished.labels(tier, "final")
            self.prediction_error.labels(tier)
            for result in ("met", "missed"):
                self.slo_requests.labels(tier, result)
            for reason in DEGRADE_REASONS:
                self.degraded.labels(tier, reason)
            for bucket in BUCKETS:
                self.admitted.labels(tier, bucket)
                for histogram in (self.ttft, self.e2e, self.chunk_gap):
                    histogram.labels(tier, bucket)

    def watch_queues(self, backlog: Backlog) -> None:
        """Export the intake streams' depth and queued tokens per tier and bucket, as the backlog probe
        last read them."""
        collector = QueueCollector(backlog)
        self.registry.register(collector)
        self._collectors.append(collector)
        self._exposed = None

    @property
    def exposed(self) -> CollectorRegistry:
        """This process's registry, or, when the multiprocess mode is on, one that pools every API
        process's samples on this host (plus what this process reads from Redis)."""
        if self._exposed is None:
            folder = os.environ.get(MULTIPROC_DIR_ENV)
            if not folder:
                self._exposed = self.registry
            else:
                self._exposed = CollectorRegistry()
                multiprocess.MultiProcessCollector(self._exposed, path=folder)  # type: ignore[no-untyped-call]
                for collector in self._collectors:
                    self._exposed.register(collector)
        return self._exposed

    def exposition(self) -> bytes:
        """The text format of ``exposed``."""
        return generate_latest(self.exposed)

    def series(self, tier: Tier, bucket: Bucket) -> Series:
        """The children a request of ``tier`` and ``bucket`` updates, looked up once per process:
        prometheus-client's ``labels()`` costs a lock and a validation at each call, seven per request."""
        found = self._series.get((tier, bucket))
        if found is None:
            found = self._series[(tier, bucket)] = Series(
                admitted=self.admitted.labels(tier, bucket),
                ttft=self.ttft.labels(tier, bucket),
                gap=self.chunk_gap.labels(tier, bucket),
                e2e=self.e2e.labels(tier, bucket),
                finished=self.finished.labels(tier, "final"),
                met=self.slo_requests.labels(tier, "met"),
                missed=self.slo_requests.labels(tier, "missed"),
                prediction_error=self.prediction_error.labels(tier),
            )
        return found

    def track(self, message: RequestMessage, admitter: Admitter) -> RequestTracker:
        series = self.series(message.tier, message.bucket)
        series.admitted.inc()
        return RequestTracker(self, series, message, admitter)


@dataclass(frozen=True, slots=True)
class Series:
    """One tier's and bucket's children of the request metrics (``ApiMetrics.series``)."""

    admitted: Counter
    ttft: Histogram
    gap: Histogram
    e2e: Histogram
    finished: Counter
    met: Counter
    missed: Counter
    prediction_error: Histogram


class RequestTracker:
    """Follows one request's batches of events for the metrics (one clock read and at most one
    observation per batch, not per token) and teaches the predictor its real length."""

    def __init__(self, metrics: ApiMetrics, series: Series, message: RequestMessage, admitter: Admitter) -> None:
        self._metrics = metrics
        self._series = series
        self._message = message
        self._admitter = admitter
        self._started = time.monotonic()
        self._first_chunk: float | None = None
        self._last_chunk: float | None = None

    def on_batch(self, batch: list[OutputEvent]) -> None:
        """Events that arrived together (and leave in one write)."""
        now: float | None = None
        for event in batch:
            if event.type == "chunk":
                if now is None:
                    now = time.monotonic()
                    if self._last_chunk is None:
                        self._first_chunk = now
                        self._series.ttft.observe(now - self._started)
                    else:
                        self._series.gap.observe(now - self._last_chunk)
                    self._last_chunk = now
            else:
                self._on_other(event)

    def _on_other(self, event: OutputEvent) -> None:
        tier = self._message.tier
        metrics, series = self._metrics, self._series
        if event.type == "final":
            e2e_s = time.monotonic() - self._started
            series.e2e.observe(e2e_s)
            series.finished.inc()
            ttft_s = self._first_chunk - self._started if self._first_chunk is not None else None
            met = metrics.slo.met(tier, ttft_s=ttft_s, e2e_s=e2e_s, output_tokens=event.completion_tokens or 0)
            (series.met if met else series.missed).inc()
            error = self._admitter.observe(self._message, event.completion_tokens or 0)
            series.prediction_error.observe(error)
        elif event.type == "error":
            metrics.finished.labels(tier, event.error_code or "error").inc()
            if event.error_code != "cancelled":
                series.missed.inc()
        elif event.type == "degraded" and event.degraded:
            self._metrics.degraded.labels(tier, str(event.degraded.get("reason", "unknown"))).inc()


class QueueCollector(Collector):
    def __init__(self, backlog: Backlog) -> None:
        self._backlog = backlog

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "tailcut_queue_depth_requests",
            "Requests in the intake streams no worker has read yet, per tier and bucket (the last probe).",
            labels=["tier", "bucket"],
        )
        for (tier, bucket), value in sorted(self._backlog.depth.items()):
            depth.add_metric([tier, bucket], value)
        yield depth
        tokens = GaugeMetricFamily(
            "tailcut_queued_tokens",
            "Tokens those requests will cost the engine (prompt, plus predicted output), per tier and bucket.",
            labels=["tier", "bucket"],
        )
        for (tier, bucket), value in sorted(self._backlog.tokens.items()):
            tokens.add_metric([tier, bucket], value)
        yield tokens


def wipe_multiprocess_dir(folder: Path) -> None:
    """Empty (or create) the multiprocess folder before the API processes start: files left by an
    earlier run would be added to this one's counts."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in folder.glob("*.db"):
        path.unlink()


def forget_dead_processes(folder: Path) -> None:
    """Drop the live gauges of API processes that are gone (a crashed one restarted by the
    supervisor), so ``tailcut_open_streams`` counts only live processes."""
    for path in folder.glob("gauge_live*_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        if not pid_alive(pid):
            multiprocess.mark_process_dead(pid, str(folder))  # type: ignore[no-untyped-call]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
