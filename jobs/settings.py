"""Batch-job settings (env prefix ``TAILCUT_``): read by ``tailcut jobs`` and by the API (the defaults
and limits of ``POST /v1/jobs``). A jobs process admits its chunk requests with the same admission
settings as the API, so a chunk lands in the bucket the API would choose."""

from __future__ import annotations

import os
import socket
import uuid

from pydantic import Field

from admission.settings import AdmissionSettings
from tailcut.settings import ReplySettings


def default_runner_id() -> str:
    return f"jobs-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class JobsSettings(AdmissionSettings, ReplySettings):
    """Batch jobs: read by the API (defaults and limits of ``POST /v1/jobs``) and by ``tailcut jobs``."""

    jobs_runner_id: str = Field(default_factory=default_runner_id, description="Names a jobs process's reply channel.")
    jobs_max_concurrent: int = Field(4, ge=1, le=1000, description="Jobs one `tailcut jobs` process runs at once.")
    jobs_max_in_flight: int = Field(
        8, ge=1, le=1024, description="Chunk requests one job keeps queued or running at once."
    )
    jobs_chunk_lines: int = Field(50, ge=1, description="Log lines per chunk when a job names none.")
    jobs_max_tokens: int = Field(256, ge=1, description="Answer length per chunk (tokens) when a job names none.")
    jobs_max_chunks: int = Field(10_000, ge=1, description="Most chunks one job may have.")
    jobs_timeout_s: float = Field(6 * 3600.0, gt=0, description="Longest a job may run (arq's job timeout).")
    jobs_result_ttl_s: int = Field(86_400, ge=60, description="How long a finished job's status and result are kept.")
    jobs_abort_wait_s: float = Field(
        5.0, ge=0, le=60, description="How long `DELETE /v1/jobs/{id}` waits for the job to stop."
    )
    metrics_host: str = Field("127.0.0.1", description="Address a worker's or jobs process's `/metrics` binds.")
    jobs_metrics_port: int = Field(
        9500, ge=0, le=65535, description="Port of a jobs process's Prometheus `/metrics` (0: not served)."
    )
    jobs_poll_delay_s: float = Field(
        0.5, gt=0, le=10, description="How often a jobs process looks for new jobs and aborts."
    )
