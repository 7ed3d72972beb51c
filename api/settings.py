"""API process settings (env prefix ``TAILCUT_``): admission's, reading replies, and the HTTP server's."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from pathlib import Path

from pydantic import Field, model_validator

from admission.settings import AdmissionSettings
from api.metrics import SloTargets
from queues.answers import CacheConfig
from queues.limits import Limits
from tailcut.settings import ReplySettings

_SLO = SloTargets()
_CACHE = CacheConfig()


def default_api_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class ApiSettings(AdmissionSettings, ReplySettings):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 picks a free one).")
    api_processes: int = Field(
        1,
        ge=1,
        le=64,
        description="API processes sharing the port (`tailcut api`); past 1 their metrics are pooled through "
        "prometheus-client's multiprocess mode in TAILCUT_METRICS_DIR.",
    )
    api_metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="A second port, on TAILCUT_HOST, that serves only `/metrics`, with no key even when "
        "TAILCUT_AUTH_REQUIRED is on: Prometheus's, on a network only it reaches (0: none).",
    )
    metrics_dir: Path | None = Field(
        None,
        description="Folder of the pooled metrics of several API processes, emptied at start; default "
        "`<temp dir>/tailcut-api-metrics-<port>`.",
    )
    status_window_s: float = Field(
        300.0, ge=10, le=86400, description="The status page's figures cover the last this many seconds."
    )
    cache_enabled: bool = Field(
        True, description="Answer exact repeats of deterministic requests from the answer cache (LRU-K in Redis)."
    )
    cache_k: int = Field(
        _CACHE.k, ge=1, le=16, description="A reply is cached on its key's K-th reference within the history window."
    )
    cache_history_s: float = Field(
        _CACHE.history_s, gt=0, description="How long a reference counts towards a key's admission to the cache."
    )
    cache_ttl_s: float = Field(_CACHE.ttl_s, gt=0, description="How long a cached reply stays valid.")
    cache_max_entries: int = Field(
        _CACHE.max_entries, ge=1, description="Most cached replies; past it the oldest K-th reference goes first."
    )
    cache_seed_file: Path | None = Field(
        None,
        description="Q&A file (JSON Lines) whose answers are served, marked `seeded`, to plain greedy chats that ask "
        "exactly its questions (optional; the answer is the file's, not the model's).",
    )
    cache_seed_top_n: int = Field(1000, ge=0, description="Seeded answers: at most this many most asked questions.")
    cache_tiny_max_entries: int = Field(
        1000,
        ge=0,
        description="Most replies in the tiny-request pool (prompts under 8 tokens with no tenant context, shared "
        "by all tenants); 0: no pool, such requests use their tenant's cache.",
    )
    slo_realtime_ttft_ms: int = Field(
        int(_SLO.realtime_ttft_s * 1000), ge=0, description="Realtime SLO: time to first token (0: no target)."
    )
    slo_realtime_e2e_ms: int = Field(
        int(_SLO.realtime_e2e_s * 1000), ge=0, description="Realtime SLO: time to the whole reply (0: no target)."
    )
    slo_normal_ttft_ms: int = Field(
        int(_SLO.normal_ttft_s * 1000), ge=0, description="Normal SLO: time to first token (0: no target)."
    )
    slo_normal_tpot_ms: int = Field(
        int(_SLO.normal_tpot_s * 1000),
        ge=0,
        description="Normal SLO: time per output token after the first (0: no target).",
    )
    slo_background_e2e_ms: int = Field(
        int(_SLO.background_e2e_s * 1000),
        ge=0,
        description="Background SLO: time to the whole reply (0: none; the tier only has to complete).",
    )
    api_id: str = Field(default_factory=default_api_id, description="Names this process's reply channel.")
    api_keys: list[str] = Field(
        default_factory=list,
        description="Accepted bearer tokens (JSON list) when TAILCUT_AUTH_REQUIRED is off; empty means no auth.",
    )
    auth_required: bool = Field(
        False,
        description="Every route but the probes needs an API key from Redis (`tailcut keys create`); the key names "
        "the tenant and the tiers it may use. `/metrics`, the status page and the admin routes need an admin key.",
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=0, description="Largest request body; a larger one is a 413 before it is parsed (0: none)."
    )
    limit_requests_per_minute: int = Field(
        0, ge=0, description="Per tenant (API keys): requests per minute, unless its key sets its own (0: none)."
    )
    limit_tokens_per_minute: int = Field(
        0, ge=0, description="Per tenant: prompt + max_tokens per minute, settled to the real count (0: none)."
    )
    limit_concurrent_requests: int = Field(
        0, ge=0, description="Per tenant: requests being answered at once (0: none)."
    )
    limit_queued_per_tier: int = Field(
        0, ge=0, description="Per tenant: accepted requests of one tier that have not started yet (0: none)."
    )
    auth_secret: str | None = Field(
        None,
        description="The deployment's secret: API keys are stored as their HMAC-SHA256 under it (required with "
        "TAILCUT_AUTH_REQUIRED and by `tailcut keys`).",
    )
    admin_key: str | None = Field(
        None,
        description="Bearer token of the admin routes (`/admin/*`, `GET /debug/stacks`), besides admin API keys; "
        "unset and TAILCUT_AUTH_REQUIRED off: those routes do not exist.",
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
    keep_alive_s: int = Field(
        75,
        ge=1,
        le=3600,
        description="How long an idle client connection is kept open for its next request. Keep it above "
        "the idle limit of every client and proxy in front (httpx 5 s, nginx 75 s, cloud load balancers "
        "60 s): a request sent on a connection just as the server closes it fails with a reset.",
    )
    sse_ping_s: float = Field(
        15.0,
        gt=0,
        le=3600,
        description="A stream that has written nothing for about this long (a request waiting in its queue) "
        "gets an SSE comment (`: ping`), so proxies and load balancers with an idle limit (nginx 60 s) do not "
        "cut it; clients skip comments. Counted from the first look in Redis that found nothing, and sent at "
        "such a look (one every `TAILCUT_REPLY_POLL_MAX_S` at most).",
    )
    shed_probe_interval_s: float = Field(
        0.1,
        gt=0,
        le=10,
        description="How often the API reads the intake streams' backlog for shedding (once a second instead "
        "while every stream is empty and this API admits nothing).",
    )

    @model_validator(mode="after")
    def _metrics_port_is_its_own(self) -> ApiSettings:
        if self.api_metrics_port and self.api_metrics_port == self.port:
            raise ValueError(
                f"TAILCUT_API_METRICS_PORT ({self.api_metrics_port}) must differ from TAILCUT_PORT: it is a second "
                "port that serves only /metrics (0: none)"
            )
        return self

    @model_validator(mode="after")
    def _auth_has_its_secret(self) -> ApiSettings:
        if self.auth_required and not self.auth_secret:
            raise ValueError(
                "TAILCUT_AUTH_REQUIRED=true needs TAILCUT_AUTH_SECRET (any long random string, the same for every "
                "API process and for `tailcut keys`): API keys are stored as their HMAC under it"
            )
        return self

    def limits(self, overrides: dict[str, int] | None = None) -> Limits:
        """The deployment's default limits, with a key's own ``overrides`` (``queues.limits.Limits`` names)."""
        defaults = Limits(
            requests_per_minute=self.limit_requests_per_minute,
            tokens_per_minute=self.limit_tokens_per_minute,
            concurrent_requests=self.limit_concurrent_requests,
            queued_per_tier=self.limit_queued_per_tier,
        )
        return dataclasses.replace(defaults, **overrides) if overrides else defaults

    def cache_config(self, *, tiny: bool = False) -> CacheConfig:
        """The answer cache's, or (``tiny``) the tiny-request pool's: the same rules, its own size."""
        return CacheConfig(
            k=self.cache_k,
            history_s=self.cache_history_s,
            ttl_s=self.cache_ttl_s,
            max_entries=self.cache_tiny_max_entries if tiny else self.cache_max_entries,
        )

    def slo_targets(self) -> SloTargets:
        return SloTargets(
            realtime_ttft_s=self.slo_realtime_ttft_ms / 1000,
            realtime_e2e_s=self.slo_realtime_e2e_ms / 1000,
            normal_ttft_s=self.slo_normal_ttft_ms / 1000,
            normal_tpot_s=self.slo_normal_tpot_ms / 1000,
            background_e2e_s=self.slo_background_e2e_ms / 1000,
        )
