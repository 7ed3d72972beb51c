"""Worker settings (env prefix ``TAILCUT_``, nested engine options as ``TAILCUT_ENGINE__NAME``)."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from tailcut.settings import CommonSettings

CPU_BLOCK_SIZE = 32  # vLLM's CPU attention accepts only multiples of 32.
GPU_BLOCK_SIZE = 16
CPU_KV_CACHE_BYTES = 512 * 1024 * 1024


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class EngineSettings(BaseModel):
    """Options handed to the inference engine of one worker pool."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="`auto` picks CUDA when the installed vLLM build targets a GPU."
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weight and activation dtype; `auto` is float32 on CPU, the model's own on GPU."
    )
    quantization: Literal["fp8"] | None = Field(None, description="Weight quantization (GPU only).")
    block_size: int | None = Field(
        None, ge=1, description="KV block size in tokens; default 16 on GPU, 32 on CPU (its only choice)."
    )
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1 << 20, description="KV cache size; default 512 MiB on CPU, `gpu_memory_utilization` on GPU."
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_seqs: int = Field(64, ge=1, description="Sequences the engine runs at once.")
    max_num_batched_tokens: int = Field(2048, ge=64, description="Engine per-step token budget (upper bound).")
    enforce_eager: bool | None = Field(None, description="Skip graph capture; default on for CPU.")
    enable_prefix_caching: bool = True

    @model_validator(mode="after")
    def _check_combinations(self) -> EngineSettings:
        if self.device == "cpu":
            if self.quantization is not None:
                raise ValueError("quantization fp8 needs a GPU; unset TAILCUT_ENGINE__QUANTIZATION on CPU")
            if self.block_size is not None and self.block_size % CPU_BLOCK_SIZE:
                raise ValueError(
                    f"block_size {self.block_size} does not work on CPU: use a multiple of {CPU_BLOCK_SIZE}"
                )
            if self.dtype == "float16":
                raise ValueError("float16 is not supported by vLLM on CPU: use float32 or bfloat16")
        return self


class WorkerSettings(CommonSettings):
    worker_id: str = Field(default_factory=default_worker_id, description="Consumer name in the group.")
    max_running: int | None = Field(
        None, ge=1, description="Requests taken from Redis at once; default the engine's max_num_seqs."
    )
    read_block_ms: int = Field(1000, ge=10, le=60_000, description="Longest blocking XREADGROUP.")
    output_ttl_s: int = Field(3600, ge=10, description="How long a request's output stream is kept.")
    drain_timeout_s: float = Field(30.0, ge=0, description="On stop, how long running requests may finish.")
    heartbeat_s: float = Field(1.0, gt=0, le=30, description="Worker liveness beat (readiness, claim refresh).")
    reclaim_after_ms: int = Field(
        15_000, ge=0, description="A pending entry idle this long belongs to a dead worker and is taken over."
    )
    reclaim_interval_s: float = Field(2.0, gt=0, description="How often a worker looks for entries to take over.")
    max_deliveries: int = Field(
        3, ge=1, description="Deliveries before an entry goes to the dead-letter stream with an error to the client."
    )
    engine: EngineSettings = Field(default_factory=lambda: EngineSettings())

    @model_validator(mode="after")
    def _check_reclaim(self) -> WorkerSettings:
        if self.reclaim_after_ms and self.reclaim_after_ms < 3 * self.heartbeat_s * 1000:
            raise ValueError(
                f"reclaim_after_ms ({self.reclaim_after_ms}) must be at least 3 heartbeats "
                f"({3 * self.heartbeat_s * 1000:.0f} ms), or live workers lose their requests to others"
            )
        return self

    @property
    def num_running_max(self) -> int:
        return self.max_running or self.engine.max_num_seqs
