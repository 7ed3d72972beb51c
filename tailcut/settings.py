"""Settings every tailcut process shares: where Redis is, which key prefix, which model.

Each process reads its settings once at start (pydantic-settings, env prefix ``TAILCUT_``) and passes
them down explicitly; nothing deeper reads the environment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "tailcut"


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TAILCUT_", env_nested_delimiter="__", extra="ignore")

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis holding the intake streams and output channels."
    )
    key_prefix: str = Field("tc:", min_length=1, description="Prefix of every Redis key tailcut writes.")
    model: str = Field(
        "smollm2",
        description="Model folder (Hugging Face layout) or `smollm2` for the embedded SmolLM2-135M-Instruct.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients send as `model`; defaults to the model folder's name."
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir, description="Where converted models are kept between runs."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context length (prompt + output); default the model's own."
    )
    redis_timeout_s: float = Field(
        0.5, gt=0, le=10, description="Connect and command timeout for non-blocking Redis calls."
    )
    log_format: str = Field("text", pattern="^(text|json)$", description="`json`: one object per line.")
    loop_lag_warn_ms: int = Field(
        100, ge=1, description="Event-loop lag that makes a process warn (a log line and a `tc:events` entry)."
    )

    @field_validator("key_prefix")
    @classmethod
    def _prefix_ends_with_colon(cls, value: str) -> str:
        if not value.endswith(":"):
            raise ValueError(f"key_prefix {value!r} must end with ':' (for example 'tc:')")
        return value


class ReplySettings(CommonSettings):
    """Settings of a process that reads its requests' replies and may cancel them (the API, ``tailcut jobs``)."""

    reply_poll_max_s: float = Field(
        5.0, gt=0, le=60, description="Longest silence before a stream re-reads its output from Redis."
    )
    cancel_ttl_s: int = Field(3600, ge=10, description="How long a cancel tombstone is kept.")
