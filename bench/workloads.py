"""Benchmark workloads: JSON files of tier mixes with SLOs, and the arrival traces drawn from them (pure).

A workload file names each tier's share of the requests, uniform ranges of prompt and output tokens
(both ends included) and the tier's SLO; ``seed-mix`` (WORKLOADS.md) ships in ``bench/workloads/``.
``load_workload`` takes a shipped name or a path. A trace is a list of ``Arrival``s: open-loop Poisson
arrivals at a rate, tier and lengths drawn from one seeded generator, so every policy and every
client sees the same requests at the same offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field, ValidationError, model_validator

from queues.keys import Tier
from tailcut.errors import FatalError
from workers.engines.costmodel import PROFILES, CostModel

WORKLOADS_DIR = Path(__file__).with_name("workloads")


class Slo(BaseModel):
    """Latency objectives of a tier; an unset one is not checked (a tier with none only has to complete)."""

    ttft_ms: float | None = Field(None, gt=0)
    e2e_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)

    def met(self, *, ttft_ms: float, e2e_ms: float, tpot_ms: float | None) -> bool:
        """Whether a completed request met every objective (TPOT is undefined for one-token replies)."""
        if self.ttft_ms is not None and ttft_ms > self.ttft_ms:
            return False
        if self.e2e_ms is not None and e2e_ms > self.e2e_ms:
            return False
        return self.tpot_ms is None or tpot_ms is None or tpot_ms <= self.tpot_ms


class TierMix(BaseModel):
    tier: Tier
    share: float = Field(gt=0, le=1)
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    slo: Slo = Field(default_factory=Slo)

    @model_validator(mode="after")
    def _check_ranges(self) -> TierMix:
        for name, (low, high) in (("prompt_tokens", self.prompt_tokens), ("output_tokens", self.output_tokens)):
            if not 1 <= low <= high:
                raise ValueError(f"{self.tier}.{name} must be [low, high] with 1 <= low <= high, got [{low}, {high}]")
        return self

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(self.prompt_tokens) / 2

    @property
    def mean_output_tokens(self) -> float:
        return sum(self.output_tokens) / 2


class Workload(BaseModel):
    name: str
    description: str = ""
    tenants: list[str] = Field(default_factory=lambda: ["default"], min_length=1)
    tiers: list[TierMix] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_shares(self) -> Workload:
        total = sum(mix.share for mix in self.tiers)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"tier shares must add up to 1, they add up to {total:g}")
        if len({mix.tier for mix in self.tiers}) != len(self.tiers):
            raise ValueError("each tier may appear once")
        return self

    def mix(self, tier: Tier) -> TierMix:
        for mix in self.tiers:
            if mix.tier == tier:
                return mix
        raise KeyError(f"workload {self.name!r} has no tier {tier!r}")

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(mix.share * mix.mean_prompt_tokens for mix in self.tiers)

    @property
    def mean_output_tokens(self) -> float:
        return sum(mix.share * mix.mean_output_tokens for mix in self.tiers)

    @property
    def max_request_tokens(self) -> int:
        return max(mix.prompt_tokens[1] + mix.output_tokens[1] for mix in self.tiers)


class WorkloadError(ValueError):
    """A workload name that is not shipped, or a file that does not describe a workload."""


def workload_and_cost(name_or_path: str, cost_model: str) -> tuple[Workload, CostModel]:
    """A command's ``--workload`` and ``--cost-model``, or the error that says what to give instead."""
    try:
        workload = load_workload(name_or_path)
    except WorkloadError as exc:
        raise FatalError(str(exc)) from exc
    cost = PROFILES.get(cost_model)
    if cost is None:
        raise FatalError(f"unknown cost model {cost_model!r}; use one of {', '.join(PROFILES)}")
    return workload, cost


def shipped_workloads() -> list[str]:
    return sorted(path.stem for path in WORKLOADS_DIR.glob("*.json"))


def load_workload(name_or_path: str) -> Workload:
    """A shipped workload by name (``seed-mix``) or a workload JSON file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = WORKLOADS_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise WorkloadError(
                f"no workload named {name_or_path!r}; shipped: {', '.join(shipped_workloads())} (or give a .json path)"
            )
    try:
        return Workload.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise WorkloadError(f"cannot read workload file {path}: {exc.strerror}") from exc
    except ValidationError as exc:
        raise WorkloadError(f"{path} is not a valid workload: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a trace: when it is sent (seconds from the start) and what it asks for."""

    index: int
    at_s: float
    tier: Tier
    tenant: str
    prompt_tokens: int
    output_tokens: int
    # An exact repeat of an earlier request sends that one's prompt (``bench.client.prompt_token_ids``).
    prompt_of: int | None = None
    # The prompt itself, when the benchmark asks real questions (``bench.warmup``); else synthetic ids.
    prompt_ids: tuple[int, ...] | None = None


def draw_requests(workload: Workload, count: int, rng: np.random.Generator) -> list[Arrival]:
    """``count`` requests (tier, tenant, lengths) at offset 0, drawn from ``rng``."""
    shares = np.array([mix.share for mix in workload.tiers])
    tier_index = rng.choice(len(workload.tiers), size=count, p=shares / shares.sum())
    tenant_index = rng.integers(0, len(workload.tenants), size=count)
    prompt_u = rng.random(count)
    output_u = rng.random(count)
    requests = []
    for index in range(count):
        mix = workload.tiers[int(tier_index[index])]
        requests.append(
            Arrival(
                index=index,
                at_s=0.0,
                tier=mix.tier,
                tenant=workload.tenants[int(tenant_index[index])],
                prompt_tokens=_uniform_int(mix.prompt_tokens, float(prompt_u[index])),
                output_tokens=_uniform_int(mix.output_tokens, float(output_u[index])),
            )
        )
    return requests


def poisson_trace(
    workload: Workload, rate_rps: float, *, seed: int, duration_s: float | None = None, count: int | None = None
) -> list[Arrival]:
    """Open-loop Poisson arrivals at ``rate_rps`` for ``duration_s`` seconds or ``count`` requests.

    The same seed gives the same request mix at every rate (the lengths and tiers come from their own
    stream), so load points differ only in spacing.
    """
    if rate_rps <= 0:
        raise ValueError(f"rate must be positive, got {rate_rps}")
    if (duration_s is None) == (count is None):
        raise ValueError("give exactly one of duration_s and count")
    if count is None:
        assert duration_s is not None
        # Enough draws that the trace outlasts the duration with overwhelming probability.
        expected = rate_rps * duration_s
        draws = int(expected + 10 * np.sqrt(expected) + 10)
    else:
        draws = count
    gaps = np.random.default_rng([seed, 1]).exponential(1.0 / rate_rps, size=draws)
    times = np.cumsum(gaps) - gaps[0]  # the first request is sent at 0
    requests = draw_requests(workload, draws, np.random.default_rng([seed, 2]))
    trace = [
        Arrival(r.index, float(at), r.tier, r.tenant, r.prompt_tokens, r.output_tokens)
        for r, at in zip(requests, times, strict=True)
    ]
    if duration_s is not None:
        trace = [arrival for arrival in trace if arrival.at_s < duration_s]
    return trace


def _uniform_int(bounds: tuple[int, int], u: float) -> int:
    low, high = bounds
    return low + min(int(u * (high - low + 1)), high - low)
