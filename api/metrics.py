"""Prometheus metrics of one API process (``GET /metrics``), on a registry of its own.

Latencies are measured here from admission (the moment the request is accepted) to the first
content chunk (TTFT) and to the terminal event (E2E), per tier; the output-length predictor's error
is recorded when the real length is known.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from admission.admitter import Admitter
from admission.shedding import Backlog
from queues.messages import OutputEvent, RequestMessage

GAP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)
TOKEN_ERROR_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 4096)


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
        )
        self.open_streams = Gauge(
            "tailcut_open_streams", "Requests this process is waiting on.", registry=self.registry
        )

    def watch_queues(self, backlog: Backlog) -> None:
        """Export the intake streams' depth per tier and bucket, as the backlog probe last read it."""
        self.registry.register(QueueDepthCollector(backlog))

    def track(self, message: RequestMessage, admitter: Admitter) -> RequestTracker:
        self.admitted.labels(message.tier, message.bucket).inc()
        return RequestTracker(self, message, admitter)


class RequestTracker:
    """Follows one request's batches of events for the metrics (one clock read and at most one
    observation per batch, not per token) and teaches the predictor its real length."""

    def __init__(self, metrics: ApiMetrics, message: RequestMessage, admitter: Admitter) -> None:
        self._metrics = metrics
        self._message = message
        self._admitter = admitter
        self._started = time.monotonic()
        self._last_chunk: float | None = None
        self._ttft = metrics.ttft.labels(message.tier, message.bucket)
        self._gap = metrics.chunk_gap.labels(message.tier, message.bucket)

    def on_batch(self, batch: list[OutputEvent]) -> None:
        """Events that arrived together (and leave in one write)."""
        now: float | None = None
        for event in batch:
            if event.type == "chunk":
                if now is None:
                    now = time.monotonic()
                    if self._last_chunk is None:
                        self._ttft.observe(now - self._started)
                    else:
                        self._gap.observe(now - self._last_chunk)
                    self._last_chunk = now
            else:
                self._on_other(event)

    def _on_other(self, event: OutputEvent) -> None:
        tier, bucket = self._message.tier, self._message.bucket
        if event.type == "final":
            self._metrics.e2e.labels(tier, bucket).observe(time.monotonic() - self._started)
            self._metrics.finished.labels(tier, "final").inc()
            error = self._admitter.observe(self._message, event.completion_tokens or 0)
            self._metrics.prediction_error.labels(tier).observe(error)
        elif event.type == "error":
            self._metrics.finished.labels(tier, event.error_code or "error").inc()
        elif event.type == "degraded" and event.degraded:
            self._metrics.degraded.labels(tier, str(event.degraded.get("reason", "unknown"))).inc()


class QueueDepthCollector(Collector):
    def __init__(self, backlog: Backlog) -> None:
        self._backlog = backlog

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "tailcut_queue_depth_requests",
            "Requests in the intake streams no worker has read yet, per tier and bucket (the last probe).",
            labels=["tier", "bucket"],
        )
        for (tier, bucket), depth in sorted(self._backlog.depth.items()):
            family.add_metric([tier, bucket], depth)
        yield family
