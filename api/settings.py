"""API process settings (env prefix ``TAILCUT_``)."""

from __future__ import annotations

import os
import socket
import uuid

from pydantic import Field, model_validator

from api.shedding import ShedLimits
from queues.keys import Tier
from tailcut.settings import CommonSettings


def default_api_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def default_tokenizer_threads() -> int:
    return min(32, (os.cpu_count() or 1) * 4)


class ApiSettings(CommonSettings):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 picks a free one).")
    api_id: str = Field(default_factory=default_api_id, description="Names this process's reply channel.")
    api_keys: list[str] = Field(
        default_factory=list, description="Accepted bearer tokens (JSON list); empty means no auth."
    )
    tokenizer_threads: int = Field(
        default_factory=default_tokenizer_threads, ge=1, le=256, description="Tokenizer thread pool size."
    )
    default_tier: Tier = Field("normal", description="Tier of a request that names none.")
    short_max_tokens: int = Field(128, ge=1, description="Bucket `short`: prompt + predicted output below this.")
    long_min_tokens: int = Field(512, ge=2, description="Bucket `long`: prompt + predicted output above this.")
    realtime_deadline_s: float = Field(5.0, gt=0, description="Deadline of a realtime request.")
    normal_deadline_s: float = Field(60.0, gt=0, description="Deadline of a normal request.")
    background_deadline_s: float = Field(3600.0, gt=0, description="Deadline of a background request.")
    reply_poll_max_s: float = Field(
        5.0, gt=0, le=60, description="Longest silence before a stream re-reads its output from Redis."
    )
    cancel_ttl_s: int = Field(3600, ge=10, description="How long a cancel tombstone is kept.")
    shed_realtime_waiting: int = Field(
        512, ge=0, description="429 for new realtime requests while this many wait (0: never shed)."
    )
    shed_normal_waiting: int = Field(256, ge=0, description="The same bound for the normal tier.")
    shed_background_waiting: int = Field(
        64, ge=0, description="The same bound for the background tier (smallest: overload sheds it first)."
    )
    shed_probe_interval_s: float = Field(
        0.1, gt=0, le=10, description="How often the API reads the intake streams' backlog for shedding."
    )

    @model_validator(mode="after")
    def _check_buckets(self) -> ApiSettings:
        if self.short_max_tokens >= self.long_min_tokens:
            raise ValueError(
                f"short_max_tokens ({self.short_max_tokens}) must be below long_min_tokens "
                f"({self.long_min_tokens}); the medium bucket lies between them"
            )
        return self

    def shed_limits(self) -> ShedLimits:
        return ShedLimits(
            realtime=self.shed_realtime_waiting,
            normal=self.shed_normal_waiting,
            background=self.shed_background_waiting,
        )

    def deadline_s(self, tier: Tier) -> float:
        return {
            "realtime": self.realtime_deadline_s,
            "normal": self.normal_deadline_s,
            "background": self.background_deadline_s,
        }[tier]
