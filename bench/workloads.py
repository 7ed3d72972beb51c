"""Benchmark workloads: JSON files of tier mixes with SLOs, and the arrival traces drawn from them (pure).

A workload file names each tier's share of the requests, the bounds of its prompt and output tokens
(both ends included) and the tier's SLO; ``bench/workloads/README.md`` describes every shipped one
(``seed-mix`` is WORKLOADS.md's). Beyond ``seed-mix``'s uniform ranges a file may give:

- per tier, ``dataset``: lengths drawn from a dataset's length table (``bench.lengthtable``, e.g.
  ShareGPT tokenised with SmolLM2) instead of uniformly; the bounds then filter the table's turns;
- per tier, ``sessions``: multi-turn chats whose later turns repeat the earlier turns and replies as
  the prompt's prefix, each sent a gap after the previous one (prefix-cache effects);
- ``arrivals``: ``poisson``, or ``gamma`` inter-arrival times with a ``burstiness`` factor exactly as
  ``vllm bench serve --burstiness`` draws them (shape = burstiness, mean = 1/rate; 1.0 is Poisson);
- ``tenant_shares``: each tenant's share of the traffic (default equal).

``load_workload`` takes a shipped name or a path. A trace is a list of ``Arrival``s at offsets from its
start, drawn from seeded generators, so every policy and every client sees the same requests at the
same offsets. A workload with none of the additions (``seed-mix``) draws exactly the trace it drew
before they existed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from bench.lengthtable import LengthTableError, load_table
from queues.keys import Tier
from tailcut.errors import FatalError
from workers.engines.costmodel import PROFILES, CostModel

WORKLOADS_DIR = Path(__file__).with_name("workloads")
# Sessions drawn to profile a tier whose lengths have no closed form (uniform sessions); fixed seed.
PROFILE_SESSIONS = 4000
PROFILE_SEED = 20_261_201
# Synthetic token ids of sessions in the simulator: far above the engine's own synthetic ids and
# ``bench.simrun``'s per-request ones, one block of ids per session, one id per position in it.
SIM_SESSION_ID_BASE = 1 << 52
SIM_SESSION_ID_STRIDE = 1 << 24


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


class DatasetLengths(BaseModel):
    """Lengths from a length table (``bench.lengthtable``): a shipped name or a path. A conversation's
    first turn is a request when its question and reply fall within the tier's bounds; with
    ``sessions``, its turns are taken in order while each does."""

    table: str = "sharegpt-smollm2"


class Sessions(BaseModel):
    """Multi-turn chats. Turn k's prompt is every earlier question and reply of the session followed by
    its own question, so it repeats turn k-1's prompt and reply as its prefix; it is sent ``turn_gap_s``
    (uniform) after turn k-1 was sent — the reply's time plus the user's reading and typing, open loop.
    A session has ``turns`` turns (uniform; from a dataset: the conversation's own turns, at most the
    upper bound, and only conversations with at least the lower bound); it ends before a turn whose
    prompt would exceed ``max_prompt_tokens`` (the user starts a new chat)."""

    turns: tuple[int, int] = (2, 4)
    turn_gap_s: tuple[float, float] = (5.0, 15.0)
    max_prompt_tokens: int = Field(2048, ge=1)

    @model_validator(mode="after")
    def _check(self) -> Sessions:
        low, high = self.turns
        if not 1 <= low <= high:
            raise ValueError(f"sessions.turns must be [low, high] with 1 <= low <= high, got [{low}, {high}]")
        gap_low, gap_high = self.turn_gap_s
        if not 0 < gap_low <= gap_high:
            raise ValueError(f"sessions.turn_gap_s must be [low, high] with 0 < low <= high, got {self.turn_gap_s}")
        return self


class Arrivals(BaseModel):
    """When requests are sent: ``poisson`` (exponential gaps of mean 1/rate), or ``gamma`` gaps of shape
    ``burstiness`` and scale 1/(rate·burstiness) — mean 1/rate, coefficient of variation
    1/sqrt(burstiness) — as ``vllm bench serve --burstiness`` draws them (below 1: burstier than Poisson).
    With sessions, these are the sessions' first turns; later turns follow their gaps."""

    process: Literal["poisson", "gamma"] = "poisson"
    burstiness: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Arrivals:
        if self.process == "poisson" and self.burstiness != 1.0:
            raise ValueError("arrivals: a burstiness other than 1 needs process 'gamma'")
        return self


@dataclass(frozen=True, slots=True)
class _Draft:
    """One session (or single request) before it is placed in time: (question, reply) per turn."""

    turns: tuple[tuple[int, int], ...]
    source: str | None  # the dataset conversation


@dataclass(frozen=True, slots=True)
class TierProfile:
    """A tier's per-request lengths over its whole pool (dataset) or a fixed-seed sample (uniform
    sessions): what the means, quantiles and maxima of the physics floor are taken from."""

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    # Prompt tokens a prefill computes when the session's previous prompt is in the prefix cache:
    # the previous reply and the new question (the whole prompt for a first turn).
    uncached_prompt_tokens: np.ndarray
    mean_turns: float


class TierMix(BaseModel):
    tier: Tier
    share: float = Field(gt=0, le=1)
    # Bounds of a request's prompt (with sessions: of one turn's question, the history not counted)
    # and output: uniform ranges, or the filter of the dataset's turns.
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    dataset: DatasetLengths | None = None
    sessions: Sessions | None = None
    slo: Slo = Field(default_factory=Slo)
    _pool: list[_Draft] | None = PrivateAttr(None)
    _profile: TierProfile | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_ranges(self) -> TierMix:
        for name, (low, high) in (("prompt_tokens", self.prompt_tokens), ("output_tokens", self.output_tokens)):
            if not 1 <= low <= high:
                raise ValueError(f"{self.tier}.{name} must be [low, high] with 1 <= low <= high, got [{low}, {high}]")
        if self.sessions is not None and self.prompt_tokens[0] > self.sessions.max_prompt_tokens:
            raise ValueError(
                f"{self.tier}: no first turn fits sessions.max_prompt_tokens {self.sessions.max_prompt_tokens} "
                f"(prompt_tokens start at {self.prompt_tokens[0]})"
            )
        if self.dataset is not None:
            try:
                self._pool = self._dataset_pool(self.dataset)
            except LengthTableError as exc:
                raise ValueError(str(exc)) from exc
            if not self._pool:
                raise ValueError(
                    f"{self.tier}: no conversation of length table {self.dataset.table!r} passes the tier's "
                    "bounds; widen prompt_tokens / output_tokens or lower sessions.turns"
                )
        return self

    def _dataset_pool(self, dataset: DatasetLengths) -> list[_Draft]:
        table = load_table(dataset.table)
        sessions = self.sessions
        max_turns = 1 if sessions is None else sessions.turns[1]
        min_turns = 1 if sessions is None else sessions.turns[0]
        max_prompt = math.inf if sessions is None else sessions.max_prompt_tokens
        pool = []
        for conversation in table.conversations:
            turns: list[tuple[int, int]] = []
            history = 0
            for turn in conversation.turns[:max_turns]:
                question, reply = turn.question_tokens, turn.reply_tokens
                if not (self._fits(question, self.prompt_tokens) and self._fits(reply, self.output_tokens)):
                    break
                if history + question > max_prompt:
                    break
                turns.append((question, reply))
                history += question + reply
            if len(turns) >= min_turns:
                pool.append(_Draft(tuple(turns), conversation.id))
        return pool

    @staticmethod
    def _fits(value: int, bounds: tuple[int, int]) -> bool:
        return bounds[0] <= value <= bounds[1]

    @property
    def is_uniform(self) -> bool:
        """Single requests of uniform lengths: ``seed-mix``'s kind, with closed-form figures."""
        return self.dataset is None and self.sessions is None

    def draft(self, rng: np.random.Generator) -> _Draft:
        """One session of this tier (one turn without ``sessions``), drawn from ``rng``."""
        if self._pool is not None:
            return self._pool[int(rng.integers(len(self._pool)))]
        question, reply = self._uniform_turn(rng)
        if self.sessions is None:
            return _Draft(((question, reply),), None)
        low, high = self.sessions.turns
        num_turns = _uniform_int((low, high), float(rng.random()))
        turns = [(question, reply)]
        history = question + reply
        for _ in range(num_turns - 1):
            question, reply = self._uniform_turn(rng)
            if history + question > self.sessions.max_prompt_tokens:
                break
            turns.append((question, reply))
            history += question + reply
        return _Draft(tuple(turns), None)

    def _uniform_turn(self, rng: np.random.Generator) -> tuple[int, int]:
        question = _uniform_int(self.prompt_tokens, float(rng.random()))
        return question, _uniform_int(self.output_tokens, float(rng.random()))

    def profile(self) -> TierProfile:
        """Every request of the pool (each session equally likely), or of a fixed-seed sample."""
        if self._profile is None:
            if self._pool is not None:
                drafts = self._pool
            else:
                rng = np.random.default_rng(PROFILE_SEED)
                drafts = [self.draft(rng) for _ in range(PROFILE_SESSIONS)]
            prompts, outputs, uncached = [], [], []
            for draft in drafts:
                history, last_reply = 0, 0
                for question, reply in draft.turns:
                    prompts.append(history + question)
                    outputs.append(reply)
                    uncached.append(last_reply + question)
                    history += question + reply
                    last_reply = reply
            self._profile = TierProfile(
                np.array(prompts), np.array(outputs), np.array(uncached), float(np.mean([len(d.turns) for d in drafts]))
            )
        return self._profile

    @property
    def mean_prompt_tokens(self) -> float:
        if self.is_uniform:
            return sum(self.prompt_tokens) / 2
        return float(self.profile().prompt_tokens.mean())

    @property
    def mean_uncached_prompt_tokens(self) -> float:
        """Mean prompt tokens a prefill computes with each session's previous prompt in the cache."""
        if self.is_uniform:
            return self.mean_prompt_tokens
        return float(self.profile().uncached_prompt_tokens.mean())

    @property
    def mean_output_tokens(self) -> float:
        if self.is_uniform:
            return sum(self.output_tokens) / 2
        return float(self.profile().output_tokens.mean())

    @property
    def mean_turns(self) -> float:
        """Requests per session (1 without sessions)."""
        return 1.0 if self.sessions is None else self.profile().mean_turns

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt a request of this tier sends (history included)."""
        if self.is_uniform:
            return self.prompt_tokens[1]
        if self.sessions is not None and self._pool is None:
            return self.sessions.max_prompt_tokens
        return int(self.profile().prompt_tokens.max())

    @property
    def max_uncached_prompt_tokens(self) -> int:
        """The longest prefill a request of this tier needs with its session's previous prompt cached."""
        if self.is_uniform:
            return self.prompt_tokens[1]
        if self._pool is None:
            return self.output_tokens[1] + self.prompt_tokens[1]  # a reply and a question at their bounds
        return int(self.profile().uncached_prompt_tokens.max())

    @property
    def max_request_tokens(self) -> int:
        if self.is_uniform or self._pool is None:
            return self.max_prompt_tokens + self.output_tokens[1]
        profile = self.profile()
        return int((profile.prompt_tokens + profile.output_tokens).max())

    def output_tokens_at(self, quantile: float) -> float:
        """The reply length at ``quantile`` of the tier's requests (linear between uniform bounds)."""
        if self.is_uniform:
            low, high = self.output_tokens
            return low + quantile * (high - low)
        return float(np.quantile(self.profile().output_tokens, quantile))


class Workload(BaseModel):
    name: str
    description: str = ""
    tenants: list[str] = Field(default_factory=lambda: ["default"], min_length=1)
    # Each tenant's share of the requests, in the order of ``tenants``; default equal.
    tenant_shares: list[float] | None = None
    arrivals: Arrivals = Field(default_factory=Arrivals)
    tiers: list[TierMix] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_shares(self) -> Workload:
        total = sum(mix.share for mix in self.tiers)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"tier shares must add up to 1, they add up to {total:g}")
        if len({mix.tier for mix in self.tiers}) != len(self.tiers):
            raise ValueError("each tier may appear once")
        if len(set(self.tenants)) != len(self.tenants):
            raise ValueError("each tenant may appear once")
        if self.tenant_shares is not None:
            if len(self.tenant_shares) != len(self.tenants):
                raise ValueError(
                    f"tenant_shares needs one share per tenant ({len(self.tenants)}), got {len(self.tenant_shares)}"
                )
            if min(self.tenant_shares) <= 0 or abs(sum(self.tenant_shares) - 1.0) > 1e-6:
                raise ValueError(f"tenant_shares must be positive and add up to 1, got {self.tenant_shares}")
        return self

    def mix(self, tier: Tier) -> TierMix:
        for mix in self.tiers:
            if mix.tier == tier:
                return mix
        raise KeyError(f"workload {self.name!r} has no tier {tier!r}")

    @property
    def is_uniform(self) -> bool:
        """Drawn as ``seed-mix`` is (and was before datasets, sessions and tenant shares existed)."""
        return self.tenant_shares is None and all(mix.is_uniform for mix in self.tiers)

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(mix.share * mix.mean_prompt_tokens for mix in self.tiers)

    @property
    def mean_uncached_prompt_tokens(self) -> float:
        return sum(mix.share * mix.mean_uncached_prompt_tokens for mix in self.tiers)

    @property
    def mean_output_tokens(self) -> float:
        return sum(mix.share * mix.mean_output_tokens for mix in self.tiers)

    @property
    def max_request_tokens(self) -> int:
        return max(mix.max_request_tokens for mix in self.tiers)

    def tenant_share(self, tenant: str) -> float:
        if self.tenant_shares is None:
            return 1.0 / len(self.tenants)
        return self.tenant_shares[self.tenants.index(tenant)]


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


def require_realtime(workload: Workload, command: str) -> None:
    """The error for a command whose figures are the realtime tier's, on a workload without one."""
    if all(mix.tier != "realtime" for mix in workload.tiers):
        raise FatalError(f"{command} measures the realtime tier, and workload {workload.name!r} has none")


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
    # Multi-turn sessions: the session (unique in the trace), the turn (0 first), how many leading
    # prompt tokens repeat the session's earlier questions and replies (``session_token_ids`` gives
    # every turn of a session the same ids there), and the index of the previous turn in this trace
    # (None for a first turn, or one sent before the trace's window opened).
    session: int | None = None
    turn: int = 0
    history_tokens: int = 0
    previous: int | None = None
    # The dataset conversation the lengths were taken from (its id in the length table and the dataset).
    source: str | None = None


def session_token_ids(session: int, num_tokens: int, *, low: int, high: int, salt: int = 0) -> list[int]:
    """The first ``num_tokens`` token ids of a session's conversation, ids drawn in ``[low, high)``:
    any two turns of a session share their common leading positions, so turn k's prompt starts with
    exactly turn k-1's prompt and (as the trace planned it) reply. For live clients (a real vocabulary);
    ``sim_session_token_ids`` is the simulator's."""
    rng = np.random.default_rng([salt, 0x5E55, session])
    return [int(token) for token in rng.integers(low, high, size=num_tokens)]


def sim_session_token_ids(session: int, num_tokens: int) -> list[int]:
    """The simulator's token ids of a session: one distinct id per position of the session's conversation."""
    first = SIM_SESSION_ID_BASE + session * SIM_SESSION_ID_STRIDE
    return list(range(first, first + num_tokens))


def draw_requests(workload: Workload, count: int, rng: np.random.Generator) -> list[Arrival]:
    """``count`` requests (tier, tenant, lengths) at offset 0, drawn from ``rng``. With sessions, whole
    sessions are drawn and laid out turn by turn (every session's first turn, then every second turn,
    ...), so a later turn is far behind its prefix in an engine's queue, as in time it is."""
    if not workload.is_uniform:
        return _draw_sessions(workload, count, rng)
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


def make_trace(
    workload: Workload,
    rate_rps: float,
    *,
    seed: int,
    duration_s: float | None = None,
    count: int | None = None,
    burstiness: float | None = None,
) -> list[Arrival]:
    """Open-loop arrivals at ``rate_rps`` (requests, later turns included) for ``duration_s`` seconds
    or ``count`` requests, spaced as the workload's ``arrivals`` say (``burstiness``: gamma gaps of that
    shape instead, as ``vllm bench serve --burstiness``).

    The requests come from their own stream, apart from the spacing. For a workload drawn as seed-mix
    is (``Workload.is_uniform``), the same seed gives the same sequence of tiers at every rate (its
    tenants and lengths are drawn in vectors as long as the trace, so they differ between rates: kept,
    so that seed-mix's figures stay comparable); for any other, the same sessions in the same order.
    With sessions, sessions also start before the window opens (as long as a session lasts), so the
    window sees steady traffic from its first second.
    """
    if rate_rps <= 0:
        raise ValueError(f"rate must be positive, got {rate_rps}")
    if (duration_s is None) == (count is None):
        raise ValueError("give exactly one of duration_s and count")
    arrivals = workload.arrivals
    if burstiness is not None:
        arrivals = Arrivals(process="gamma", burstiness=burstiness)
    if not workload.is_uniform:
        return _session_trace(workload, rate_rps, arrivals, seed=seed, duration_s=duration_s, count=count)
    draws = count if count is not None else _enough_draws(rate_rps, duration_s or 0.0, arrivals.burstiness)
    gaps = _gaps(arrivals, rate_rps, draws, np.random.default_rng([seed, 1]))
    times = np.cumsum(gaps) - gaps[0]  # the first request is sent at 0
    requests = draw_requests(workload, draws, np.random.default_rng([seed, 2]))
    trace = [
        Arrival(r.index, float(at), r.tier, r.tenant, r.prompt_tokens, r.output_tokens)
        for r, at in zip(requests, times, strict=True)
    ]
    if duration_s is not None:
        trace = [arrival for arrival in trace if arrival.at_s < duration_s]
    return trace


def poisson_trace(
    workload: Workload,
    rate_rps: float,
    *,
    seed: int,
    duration_s: float | None = None,
    count: int | None = None,
) -> list[Arrival]:
    """``make_trace`` under its first name: Poisson unless the workload's ``arrivals`` say gamma."""
    return make_trace(workload, rate_rps, seed=seed, duration_s=duration_s, count=count)


def interarrival_gaps(arrivals: Arrivals, rate_rps: float, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` gaps between sends (seconds) of mean ``1 / rate_rps``."""
    return _gaps(arrivals, rate_rps, count, rng)


def _gaps(arrivals: Arrivals, rate_rps: float, count: int, rng: np.random.Generator) -> np.ndarray:
    if arrivals.process == "poisson":
        return rng.exponential(1.0 / rate_rps, size=count)
    # vllm/benchmarks/serve.py: theta = 1 / (request_rate * burstiness); np.random.gamma(burstiness, theta)
    return rng.gamma(shape=arrivals.burstiness, scale=1.0 / (rate_rps * arrivals.burstiness), size=count)


def _enough_draws(rate_rps: float, duration_s: float, burstiness: float) -> int:
    """Enough draws that the trace outlasts the duration with overwhelming probability (the count of
    a renewal process has variance ``expected · CV²``, CV² = 1/burstiness)."""
    expected = rate_rps * duration_s
    return int(expected + 10 * np.sqrt(expected / burstiness) + 10)


def _start_shares(workload: Workload) -> tuple[np.ndarray, float]:
    """Each tier's share of session starts (so that its share of *requests* is its ``share``) and the
    mean requests per start."""
    per_start = np.array([mix.share / mix.mean_turns for mix in workload.tiers])
    return per_start / per_start.sum(), 1.0 / float(per_start.sum())


def _pick(cumulative: np.ndarray, u: float) -> int:
    return min(int(np.searchsorted(cumulative, u, side="right")), len(cumulative) - 1)


@dataclass(frozen=True, slots=True)
class _Start:
    session: int
    at_s: float
    tier: TierMix
    tenant: str
    draft: _Draft
    turn_gaps_s: tuple[float, ...]


def _starts(
    workload: Workload, times: Sequence[float], sessions: Sequence[int], rng: np.random.Generator
) -> list[_Start]:
    """Tier, tenant, session and turn gaps for each start time, drawn from ``rng`` start by start."""
    tier_shares, _ = _start_shares(workload)
    tier_cumulative = np.cumsum(tier_shares)
    tenant_cumulative = np.cumsum([workload.tenant_share(tenant) for tenant in workload.tenants])
    starts = []
    for session, at_s in zip(sessions, times, strict=True):
        mix = workload.tiers[_pick(tier_cumulative, float(rng.random()))]
        tenant = workload.tenants[_pick(tenant_cumulative, float(rng.random()))]
        draft = mix.draft(rng)
        gaps: tuple[float, ...] = ()
        if len(draft.turns) > 1:
            assert mix.sessions is not None
            gaps = tuple(float(g) for g in rng.uniform(*mix.sessions.turn_gap_s, size=len(draft.turns) - 1))
        starts.append(_Start(session, float(at_s), mix, tenant, draft, gaps))
    return starts


def _session_span_s(workload: Workload) -> float:
    """The longest a session lasts from its first turn to its last."""
    return max(
        ((mix.sessions.turns[1] - 1) * mix.sessions.turn_gap_s[1] for mix in workload.tiers if mix.sessions),
        default=0.0,
    )


def _session_trace(
    workload: Workload,
    rate_rps: float,
    arrivals: Arrivals,
    *,
    seed: int,
    duration_s: float | None,
    count: int | None,
) -> list[Arrival]:
    _, requests_per_start = _start_shares(workload)
    start_rate = rate_rps / requests_per_start
    # Starts from 0 on: gaps from stream 1, sessions from stream 2 (as the uniform trace's requests).
    if count is not None:
        # The count-th start comes no earlier than the count-th request: every request before it is drawn.
        draws = count
    else:
        assert duration_s is not None
        draws = _enough_draws(start_rate, duration_s, arrivals.burstiness)
    gaps = _gaps(arrivals, start_rate, draws, np.random.default_rng([seed, 1]))
    times = np.cumsum(gaps) - gaps[0]
    starts = _starts(workload, times.tolist(), range(0, 2 * draws, 2), np.random.default_rng([seed, 2]))
    # Sessions already under way when the window opens: backwards from 0, streams 3 and 4.
    span_s = _session_span_s(workload)
    if span_s > 0:
        draws_before = _enough_draws(start_rate, span_s, arrivals.burstiness)
        before = -np.cumsum(_gaps(arrivals, start_rate, draws_before, np.random.default_rng([seed, 3])))
        before = before[before >= -span_s]
        starts += _starts(workload, before.tolist(), range(1, 2 * len(before) + 1, 2), np.random.default_rng([seed, 4]))
    planned: list[tuple[float, int, int, _Start, int, int, int]] = []
    for start in starts:
        at_s, history = start.at_s, 0
        for turn, (question, reply) in enumerate(start.draft.turns):
            if turn:
                at_s += start.turn_gaps_s[turn - 1]
            if at_s >= 0 and (duration_s is None or at_s < duration_s):
                planned.append((at_s, start.session, turn, start, history + question, reply, history))
            history += question + reply
    planned.sort(key=lambda item: (item[0], item[1], item[2]))
    if count is not None:
        planned = planned[:count]
    index_of = {(session, turn): index for index, (_, session, turn, *_rest) in enumerate(planned)}
    trace = []
    for index, (at_s, session, turn, start, prompt, output, history) in enumerate(planned):
        has_sessions = start.tier.sessions is not None
        trace.append(
            Arrival(
                index=index,
                at_s=at_s,
                tier=start.tier.tier,
                tenant=start.tenant,
                prompt_tokens=prompt,
                output_tokens=output,
                session=session if has_sessions else None,
                turn=turn,
                history_tokens=history,
                previous=index_of.get((session, turn - 1)) if turn else None,
                source=start.draft.source,
            )
        )
    return trace


def _draw_sessions(workload: Workload, count: int, rng: np.random.Generator) -> list[Arrival]:
    _, requests_per_start = _start_shares(workload)
    starts: list[_Start] = []
    total = 0
    while total < count:
        num_starts = max(1, math.ceil((count - total) / requests_per_start))
        batch = _starts(workload, [0.0] * num_starts, range(len(starts), len(starts) + num_starts), rng)
        starts += batch
        total += sum(len(start.draft.turns) for start in batch)
    planned = []
    for start in starts:
        history = 0
        for turn, (question, reply) in enumerate(start.draft.turns):
            planned.append((turn, start.session, start, history + question, reply, history))
            history += question + reply
    planned.sort(key=lambda item: (item[0], item[1]))
    planned = planned[:count]
    index_of = {(session, turn): index for index, (turn, session, *_rest) in enumerate(planned)}
    return [
        Arrival(
            index=index,
            at_s=0.0,
            tier=start.tier.tier,
            tenant=start.tenant,
            prompt_tokens=prompt,
            output_tokens=output,
            session=session if start.tier.sessions is not None else None,
            turn=turn,
            history_tokens=history,
            previous=index_of.get((session, turn - 1)) if turn else None,
            source=start.draft.source,
        )
        for index, (turn, session, start, prompt, output, history) in enumerate(planned)
    ]


def _uniform_int(bounds: tuple[int, int], u: float) -> int:
    low, high = bounds
    return low + min(int(u * (high - low + 1)), high - low)
