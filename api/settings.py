"""API process settings (env prefix ``TAILCUT_``): admission's, reading replies, and the HTTP server's."""

from __future__ import annotations

import os
import socket
import uuid

from pydantic import Field

from admission.settings import AdmissionSettings
from tailcut.settings import ReplySettings


def default_api_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class ApiSettings(AdmissionSettings, ReplySettings):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 picks a free one).")
    api_id: str = Field(default_factory=default_api_id, description="Names this process's reply channel.")
    api_keys: list[str] = Field(
        default_factory=list, description="Accepted bearer tokens (JSON list); empty means no auth."
    )
    admin_key: str | None = Field(
        None,
        description="Bearer token of the admin-only routes (`GET /debug/stacks`); unset: those routes do not exist.",
    )
    resume_grace_s: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="A client of a resumable request (sent with an Idempotency-Key) that leaves cancels it only "
        "after this long, and only if no client attached again (0: at once).",
    )
    idempotency_ttl_s: int = Field(
        3600,
        ge=10,
        description="How long a request stays resumable and its Idempotency-Key replays it; keep at most "
        "TAILCUT_OUTPUT_TTL_S.",
    )
    shutdown_grace_s: float = Field(
        15.0,
        ge=0,
        le=3600,
        description="On SIGTERM, how long open replies may run to their end; one still running then ends "
        "with a `server_shutting_down` error saying how to resume it (the request itself runs on).",
    )
    shed_probe_interval_s: float = Field(
        0.1, gt=0, le=10, description="How often the API reads the intake streams' backlog for shedding."
    )
