"""``tailcut bench live``'s comparison: one policy's run on each clock (``Side``), the two side by side
(``PolicyResult``), and the ratios tailcut / fifo of both clocks, which agree within a tolerance or not."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from bench.live_records import latencies_ms, paired_delta_ms
from bench.simrun import floor_e2e_ms
from bench.stats import RequestRecord, attainment, field_of, summarize
from bench.workloads import Workload
from queues.keys import TIERS
from workers.engines.costmodel import CostModel

LivePolicy = Literal["fifo", "tailcut"]
LIVE_POLICIES: tuple[LivePolicy, ...] = ("fifo", "tailcut")
# Live and virtual ratios agree when |live / virtual − 1| is at most this.
AGREEMENT_TOLERANCE = 0.25
# The virtual clock's own spread (``RatioCheck``): the trace replayed this many times with
# each arrival moved by a uniform 0 to REPLAY_JITTER_MS simulated ms. The live pipeline hands each
# request to the engine about that much after its offset (the API, Redis and the worker's read take
# 2–13 real ms, 0.1–0.8 simulated at ×16), so a live run is one more such phase of the same trace.
REPLAYS = 10
REPLAY_JITTER_MS = 1.0
NOTE = "SIMULATOR engine in real time ×{scale:g} (live pipeline) vs the virtual clock; cost model {cost}"


@dataclass(frozen=True, slots=True)
class LiveSetup:
    workload: Workload
    cost: CostModel
    load: float  # share of fifo's capacity
    duration_s: float  # simulated seconds of arrivals
    time_scale: float
    seed: int
    policies: tuple[LivePolicy, ...]
    model_dir: Path  # its tokenizer serves the API; the sim engine runs no model
    log_dir: Path  # the API's and the worker's logs go here
    show_progress: bool = False


def agrees(live: float, virtual: float, tolerance: float = AGREEMENT_TOLERANCE) -> bool:
    """Whether a live ratio agrees with the virtual one: |live / virtual − 1| ≤ ``tolerance``."""
    if virtual == 0:
        return live == 0
    return abs(live / virtual - 1) <= tolerance


@dataclass(slots=True)
class Side:
    """One policy's run on one clock, every time in simulated time."""

    records: list[RequestRecord]
    end_s: float  # when the run ended (the last request finished, or the bound)
    background_tokens: float  # background output tokens within the arrival window
    metrics: dict[str, Any]
    stats: dict[str, Any]


def side(
    records: list[RequestRecord],
    *,
    end_s: float,
    background_tokens: float,
    setup: LiveSetup,
    rate_rps: float,
    stats: dict[str, Any],
) -> Side:
    metrics: dict[str, Any] = {}
    for tier in TIERS:
        mine = [record for record in records if record.tier == tier]
        if not mine:
            continue
        ttft = summarize(latencies_ms(mine, "ttft_ms", end_s))
        e2e = summarize(latencies_ms(mine, "e2e_ms", end_s))
        metrics[tier] = {
            "requests": len(mine),
            "ok": sum(record.status == "ok" for record in mine),
            "rejected": sum(record.status == "rejected" for record in mine),
            "errors": sum(record.status == "error" for record in mine),
            "p50_ttft_ms": field_of(ttft, "p50"),
            "p90_ttft_ms": field_of(ttft, "p90"),
            "p99_ttft_ms": field_of(ttft, "p99"),
            "p50_e2e_ms": field_of(e2e, "p50"),
            "p99_e2e_ms": field_of(e2e, "p99"),
            "max_e2e_ms": field_of(e2e, "max"),
            "floor_e2e_ms": floor_e2e_ms(setup.workload, setup.cost, rate_rps, tier),
            "attainment": attainment(mine, setup.workload.mix(tier).slo),
        }
    metrics["background_tokens_per_s"] = background_tokens / setup.duration_s
    return Side(records, end_s, background_tokens, metrics, stats)


@dataclass(slots=True)
class PolicyResult:
    policy: LivePolicy
    live: Side
    virtual: Side

    def paired(self) -> dict[str, Any]:
        """Live minus virtual per request, realtime tier (simulated ms)."""
        return {
            metric: None
            if (delta := paired_delta_ms(self.live.records, self.virtual.records, metric, "realtime")) is None
            else asdict(delta)
            for metric in ("ttft_ms", "e2e_ms")
        }

    def realtime_p99_ttft_unstalled_ms(self, side: Side) -> float:
        """Realtime P99 TTFT of ``side`` without the requests whose first token the live client awaited
        during one of its stalls (the same requests left out on both clocks)."""
        stalled = set(self.live.stats.get("client_stalls", {}).get("first_token_awaited", []))
        mine = [record for record in side.records if record.tier == "realtime" and record.index not in stalled]
        return field_of(summarize(latencies_ms(mine, "ttft_ms", side.end_s)), "p99") or 0.0


@dataclass(frozen=True, slots=True)
class RatioCheck:
    """One ratio on both clocks. ``virtual`` is the trace as drawn; ``replays`` the same ratio on the
    virtual clock with every arrival moved by up to ``REPLAY_JITTER_MS``: a P99 of a
    20-second trace is a handful of requests, and which step a burst lands in moves it by ±10% on the
    virtual clock alone. ``agree`` compares live with ``virtual``; ``agree_replays`` with the replays'
    median (the drawn trace's figure among them), the live run being one more arrival phase."""

    name: str
    live: float
    virtual: float
    agree: bool
    key: bool = True  # one of the ratios; the others only help read them
    replays: tuple[float, ...] = ()

    @property
    def off(self) -> float:
        """Live over virtual, minus one."""
        return self.live / self.virtual - 1 if self.virtual else float("inf")

    @property
    def virtual_median(self) -> float:
        return statistics.median((self.virtual, *self.replays))

    @property
    def agree_replays(self) -> bool:
        return agrees(self.live, self.virtual_median)


@dataclass(slots=True)
class LiveReport:
    setup: LiveSetup
    capacity_rps: float
    rate_rps: float  # simulated requests per second
    num_requests: int
    results: list[PolicyResult]
    ratios: list[RatioCheck]
    wall_s: float

    @property
    def note(self) -> str:
        return NOTE.format(scale=self.setup.time_scale, cost=self.setup.cost.name)


def ratio_checks(
    results: Sequence[PolicyResult], replays: Sequence[Mapping[LivePolicy, Side]] = ()
) -> list[RatioCheck]:
    """tailcut / fifo of the key figures, live and virtual (needs both policies), with the virtual
    figure of each replay (``RatioCheck``). Two extras help read the P99 TTFT: the P90, less sensitive
    to a few requests delayed together, and the P99 without the requests whose first token the live
    client awaited while it stalled (on the drawn trace only)."""
    by_policy = {result.policy: result for result in results}
    if not {"fifo", "tailcut"} <= set(by_policy):
        return []
    ours, fifo = by_policy["tailcut"], by_policy["fifo"]

    def realtime(key: str) -> Callable[[Side], float]:
        return lambda side: float(side.metrics.get("realtime", {}).get(key) or 0)

    figures: list[tuple[str, Callable[[Side], float], bool]] = [
        ("realtime P99 TTFT, tailcut / fifo", realtime("p99_ttft_ms"), True),
        ("realtime P99 E2E, tailcut / fifo", realtime("p99_e2e_ms"), True),
        ("background tok/s, tailcut / fifo", lambda side: float(side.metrics["background_tokens_per_s"]), True),
        ("realtime P90 TTFT, tailcut / fifo", realtime("p90_ttft_ms"), False),
    ]
    checks = []
    unstalled = (
        "realtime P99 TTFT without client-stalled first tokens, tailcut / fifo",
        (ours.realtime_p99_ttft_unstalled_ms(ours.live), ours.realtime_p99_ttft_unstalled_ms(ours.virtual)),
        (fifo.realtime_p99_ttft_unstalled_ms(fifo.live), fifo.realtime_p99_ttft_unstalled_ms(fifo.virtual)),
    )
    for name, figure, key in figures:
        if not figure(fifo.live) or not figure(fifo.virtual):
            continue  # the workload has no such tier
        live = figure(ours.live) / figure(fifo.live)
        virtual = figure(ours.virtual) / figure(fifo.virtual)
        replayed = tuple(figure(replay["tailcut"]) / figure(replay["fifo"]) for replay in replays)
        checks.append(RatioCheck(name, live, virtual, agrees(live, virtual), key, replayed))
    name, (ours_live, ours_virtual), (fifo_live, fifo_virtual) = unstalled
    if fifo_live and fifo_virtual:
        live, virtual = ours_live / fifo_live, ours_virtual / fifo_virtual
        checks.append(RatioCheck(name, live, virtual, agrees(live, virtual), key=False))
    return checks
