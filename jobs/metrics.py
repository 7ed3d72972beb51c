"""Prometheus metrics of one jobs process (``tailcut jobs``), served on ``TAILCUT_JOBS_METRICS_PORT``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class JobsMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.jobs = Counter(
            "tailcut_jobs_total",
            "Job runs this process ended, by how they ended (complete, failed, aborted, or stopped: handed "
            "back to the queue when the process stopped).",
            ["status"],
            registry=self.registry,
        )
        self.running = Gauge("tailcut_jobs_running", "Jobs this process runs now.", registry=self.registry)
        self.chunks = Counter(
            "tailcut_job_chunks_total",
            "Chunk requests answered (ok) or failed, the combining request included.",
            ["outcome"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "tailcut_job_requests_in_flight", "Chunk requests queued or running for this process's jobs.",
            registry=self.registry,
        )  # fmt: skip
        for status in ("complete", "failed", "aborted", "stopped"):
            self.jobs.labels(status)
        for outcome in ("ok", "failed"):
            self.chunks.labels(outcome)
