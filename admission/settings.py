"""Admission settings of every process that admits requests (the API, ``tailcut jobs``), env prefix
``TAILCUT_``. Their defaults come from ``admission.config``; ``config()`` turns them into it."""

from __future__ import annotations

import os

from pydantic import Field, model_validator

from admission.config import AdmissionConfig, BucketEdges, Deadlines
from admission.shedding import ShedLimits
from queues.keys import Tier
from tailcut.settings import CommonSettings

_CONFIG = AdmissionConfig()


def default_tokenizer_threads() -> int:
    return min(32, (os.cpu_count() or 1) * 4)


class AdmissionSettings(CommonSettings):
    tokenizer_threads: int = Field(
        default_factory=default_tokenizer_threads, ge=1, le=256, description="Tokenizer thread pool size."
    )
    default_tier: Tier = Field(_CONFIG.default_tier, description="Tier of a request that names none.")
    short_max_tokens: int = Field(
        _CONFIG.buckets.short_max_tokens, ge=1, description="Bucket `short`: prompt + predicted output below this."
    )
    long_min_tokens: int = Field(
        _CONFIG.buckets.long_min_tokens, ge=2, description="Bucket `long`: prompt + predicted output above this."
    )
    realtime_deadline_s: float = Field(
        _CONFIG.deadlines.realtime_s, gt=0, description="Deadline of a realtime request."
    )
    normal_deadline_s: float = Field(_CONFIG.deadlines.normal_s, gt=0, description="Deadline of a normal request.")
    background_deadline_s: float = Field(
        _CONFIG.deadlines.background_s, gt=0, description="Deadline of a background request."
    )
    shed_realtime_waiting: int = Field(
        _CONFIG.shed.realtime, ge=0, description="429 for new realtime requests while this many wait (0: never shed)."
    )
    shed_normal_waiting: int = Field(_CONFIG.shed.normal, ge=0, description="The same bound for the normal tier.")
    shed_background_waiting: int = Field(
        _CONFIG.shed.background,
        ge=0,
        description="The same bound for the background tier (smallest: overload sheds it first).",
    )
    shed_realtime_wait_ms: int = Field(
        _CONFIG.shed.realtime_wait_ms,
        ge=0,
        description="429 for new realtime requests while the oldest waiting one has waited this long (0: no bound).",
    )
    shed_normal_wait_ms: int = Field(
        _CONFIG.shed.normal_wait_ms,
        ge=0,
        description="The same wait bound for the normal tier (e.g. twice its TTFT target on a GPU engine).",
    )
    shed_background_wait_ms: int = Field(
        _CONFIG.shed.background_wait_ms, ge=0, description="The same wait bound for the background tier."
    )

    @model_validator(mode="after")
    def _check_buckets(self) -> AdmissionSettings:
        if self.short_max_tokens >= self.long_min_tokens:
            raise ValueError(
                f"short_max_tokens ({self.short_max_tokens}) must be below long_min_tokens "
                f"({self.long_min_tokens}); the medium bucket lies between them"
            )
        return self

    def admission_config(self) -> AdmissionConfig:
        return AdmissionConfig(
            default_tier=self.default_tier,
            buckets=BucketEdges(short_max_tokens=self.short_max_tokens, long_min_tokens=self.long_min_tokens),
            deadlines=Deadlines(
                realtime_s=self.realtime_deadline_s,
                normal_s=self.normal_deadline_s,
                background_s=self.background_deadline_s,
            ),
            shed=ShedLimits(
                realtime=self.shed_realtime_waiting,
                normal=self.shed_normal_waiting,
                background=self.shed_background_waiting,
                realtime_wait_ms=self.shed_realtime_wait_ms,
                normal_wait_ms=self.shed_normal_wait_ms,
                background_wait_ms=self.shed_background_wait_ms,
            ),
        )
