"""Settings every tailcut process shares: where Redis is, which key prefix, which model.

Each process reads its settings once at start (pydantic-settings, env prefix ``TAILCUT_``) and passes
them down explicitly; nothing deeper reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Redis's own sample sentinel.conf (and arq, and most operators) name the monitored primary so.
DEFAULT_SENTINEL_MASTER = "mymaster"


@dataclass(frozen=True, slots=True)
class RedisEndpoint:
    """Where a process finds Redis: ``url`` alone, or the primary ``master`` that ``sentinels`` watch
    (then ``url`` gives only the user, password, database and TLS of the data connections;
    ``sentinel_username`` / ``sentinel_password`` authenticate to the Sentinels themselves)."""

    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = DEFAULT_SENTINEL_MASTER
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    def __str__(self) -> str:  # for logs: never the password
        if not self.sentinels:
            return _without_password(self.url)
        return f"sentinel:{self.master}@" + ",".join(f"{host}:{port}" for host, port in self.sentinels)


def parse_sentinels(text: str) -> tuple[tuple[str, int], ...]:
    """``host:port,host:port`` (spaces allowed; ``[v6]:port`` too) → address pairs; ValueError on bad input."""
    addresses: list[tuple[str, int]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{item!r} is not host:port (a Sentinel address, e.g. 10.0.0.5:26379)")
        addresses.append((host.strip("[]"), int(port)))
    return tuple(addresses)


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    user = credentials.partition(":")[0]
    return f"{scheme}://{user + ':***' if user else '***'}@{host}"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "tailcut"


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TAILCUT_", env_nested_delimiter="__", extra="ignore")

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis holding the intake streams and output channels."
    )
    redis_sentinels: str = Field(
        "",
        description="Redis Sentinel addresses (`host:port,host:port`): when set, every connection goes to the "
        "primary they report for `redis_sentinel_master` and follows a failover; `redis_url` then gives only "
        "the user, password, database and TLS (its host and port are not used).",
    )
    redis_sentinel_master: str = Field(
        DEFAULT_SENTINEL_MASTER, min_length=1, description="Name the Sentinels monitor the primary under."
    )
    redis_sentinel_username: str | None = Field(None, description="User for the Sentinels themselves (ACL).")
    redis_sentinel_password: SecretStr | None = Field(
        None, description="Password for the Sentinels themselves (`requirepass` in sentinel.conf)."
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

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinels_parse(cls, value: str) -> str:
        parse_sentinels(value)
        return value

    @property
    def redis(self) -> RedisEndpoint:
        """Where this process finds Redis (``queues.connection``)."""
        password = self.redis_sentinel_password
        return RedisEndpoint(
            self.redis_url,
            sentinels=parse_sentinels(self.redis_sentinels),
            master=self.redis_sentinel_master,
            sentinel_username=self.redis_sentinel_username,
            sentinel_password=password.get_secret_value() if password is not None else None,
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
    intake_durability: Literal["primary", "replica"] = Field(
        "primary",
        description="When a request counts as accepted: `primary` once the Redis primary has its intake entry; "
        "`replica` only once `WAIT 1` confirms a replica has it too (else it is withdrawn and answered 503), "
        "so a failover cannot lose it.",
    )
    intake_replica_wait_ms: int = Field(
        100,
        ge=1,
        le=10_000,
        description="With `replica` durability: how long an enqueue waits for a replica's confirmation.",
    )

    @model_validator(mode="after")
    def _wait_fits_timeout(self) -> ReplySettings:
        if self.intake_durability == "replica" and self.intake_replica_wait_ms >= self.redis_timeout_s * 1000:
            raise ValueError(
                f"intake_replica_wait_ms ({self.intake_replica_wait_ms}) must be shorter than redis_timeout_s "
                f"({self.redis_timeout_s} s), or the command times out before WAIT answers: raise "
                "TAILCUT_REDIS_TIMEOUT_S or lower TAILCUT_INTAKE_REPLICA_WAIT_MS"
            )
        return self

    @property
    def intake_replicas(self) -> int:
        """Replicas that must confirm an intake entry before it counts as accepted (0: the primary's word)."""
        return 1 if self.intake_durability == "replica" else 0
