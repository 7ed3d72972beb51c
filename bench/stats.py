"""Per-request records → percentile summaries, SLO attainment and goodput per tier and bucket (pure).

The live load generator and the virtual-clock simulator both reduce their requests to ``RequestRecord``s
and report through the same functions, so a live figure and a simulated one mean the same thing. Metric
definitions are WORKLOADS.md's: TTFT = send → first content chunk, E2E = send → final event,
TPOT = (E2E − TTFT) / (output tokens − 1), inter-chunk gaps pooled over requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from rich.table import Table

from bench.workloads import Slo
from queues.keys import BUCKETS, TIERS, Tier

Status = Literal["ok", "rejected", "error"]
Metric = Literal["ttft_ms", "e2e_ms", "tpot_ms"]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request did, seen from the client. ``status``: ``rejected`` is an HTTP 429 (shed),
    ``error`` anything else that did not complete (``error`` says what); only ``ok`` requests can meet an SLO.
    ``bucket`` is the length bucket (the client's approximation when measured live)."""

    index: int
    tier: Tier
    bucket: str | None
    tenant: str
    prompt_tokens: int
    output_tokens: int
    sent_s: float
    ttft_ms: float | None
    e2e_ms: float | None
    tpot_ms: float | None
    gaps_ms: list[float]
    status: Status
    error: str | None = None


@dataclass(frozen=True, slots=True)
class TargetCheck:
    """One benchmark target: the measured value (``None`` when it could not be measured), what was
    wanted, and whether it was met."""

    name: str
    value: float | None
    target: str
    met: bool


def tpot_ms(*, ttft_ms: float, e2e_ms: float, output_tokens: int) -> float | None:
    """Time per output token after the first; undefined for replies of fewer than two tokens."""
    if output_tokens < 2:
        return None
    return (e2e_ms - ttft_ms) / (output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Summary:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def field_of(summary: Summary | None, name: str) -> float | None:
    """One figure of a summary (``p50``, ``p99``, ...); None for a group with nothing in it."""
    return None if summary is None else float(getattr(summary, name))


def summarize(values: Sequence[float]) -> Summary | None:
    """P50/P90/P99 with numpy's default (linear) interpolation; None when there is nothing to summarise."""
    if not values:
        return None
    array = np.asarray(values, dtype=float)
    p50, p90, p99 = (float(value) for value in np.percentile(array, [50, 90, 99]))
    return Summary(len(array), float(array.mean()), p50, p90, p99, float(array.max()))


def met_slo(record: RequestRecord, slo: Slo) -> bool:
    """A request meets its tier's SLO only if it completed and met every objective."""
    if record.status != "ok" or record.ttft_ms is None or record.e2e_ms is None:
        return False
    return slo.met(ttft_ms=record.ttft_ms, e2e_ms=record.e2e_ms, tpot_ms=record.tpot_ms)


def attainment(records: Sequence[RequestRecord], slo: Slo) -> float:
    """Share of ``records`` (one tier's) that met every SLO; rejected and failed requests are misses."""
    if not records:
        return 0.0
    return sum(met_slo(record, slo) for record in records) / len(records)


def goodput_rps(records: Iterable[RequestRecord], slos: Mapping[Tier, Slo], duration_s: float) -> float:
    """Requests per second that met every SLO of their own tier."""
    return sum(met_slo(record, slos[record.tier]) for record in records) / duration_s


def output_tokens_per_s(records: Iterable[RequestRecord], duration_s: float) -> float:
    """Output tokens of completed requests per second (tokens of failed requests are not throughput)."""
    return sum(record.output_tokens for record in records if record.status == "ok") / duration_s


def values_of(records: Iterable[RequestRecord], metric: Metric) -> list[float]:
    """The defined values of one per-request metric (TTFT, E2E or TPOT) of completed requests."""
    values = (getattr(record, metric) for record in records if record.status == "ok")
    return [value for value in values if value is not None]


def by_tier(records: Iterable[RequestRecord], metric: Metric) -> dict[str, list[float]]:
    """``{tier: values}`` of one metric, the input of ``bench.plots.plot_cdf``."""
    grouped: dict[str, list[RequestRecord]] = {}
    for record in records:
        grouped.setdefault(record.tier, []).append(record)
    return {tier: values_of(grouped[tier], metric) for tier in TIERS if tier in grouped}


@dataclass(frozen=True, slots=True)
class ReportRow:
    """One tier (``bucket`` None: all its buckets) or one tier × bucket of a run."""

    tier: Tier
    bucket: str | None
    num_requests: int
    num_ok: int
    num_rejected: int
    num_errors: int
    ttft_ms: Summary | None
    e2e_ms: Summary | None
    tpot_ms: Summary | None
    gap_ms: Summary | None
    attainment: float
    goodput_rps: float
    output_tokens_per_s: float


def report_row(
    tier: Tier, bucket: str | None, records: Sequence[RequestRecord], slo: Slo, duration_s: float
) -> ReportRow:
    """The row of one group of records; ``duration_s`` is the run's length, the denominator of rates."""
    return ReportRow(
        tier=tier,
        bucket=bucket,
        num_requests=len(records),
        num_ok=sum(record.status == "ok" for record in records),
        num_rejected=sum(record.status == "rejected" for record in records),
        num_errors=sum(record.status == "error" for record in records),
        ttft_ms=summarize(values_of(records, "ttft_ms")),
        e2e_ms=summarize(values_of(records, "e2e_ms")),
        tpot_ms=summarize(values_of(records, "tpot_ms")),
        gap_ms=summarize([gap for record in records if record.status == "ok" for gap in record.gaps_ms]),
        attainment=attainment(records, slo),
        goodput_rps=goodput_rps(records, {tier: slo}, duration_s),
        output_tokens_per_s=output_tokens_per_s(records, duration_s),
    )


def report_rows(
    records: Iterable[RequestRecord], slos: Mapping[Tier, Slo], duration_s: float
) -> tuple[list[ReportRow], list[ReportRow]]:
    """(one row per tier, one row per tier × bucket), in tier then bucket order, empty groups left out."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    tiers: dict[Tier, list[RequestRecord]] = {}
    buckets: dict[tuple[Tier, str | None], list[RequestRecord]] = {}
    for record in records:
        tiers.setdefault(record.tier, []).append(record)
        buckets.setdefault((record.tier, record.bucket), []).append(record)
    bucket_order: dict[str, int] = {bucket: position for position, bucket in enumerate(BUCKETS)}

    def bucket_key(key: tuple[Tier, str | None]) -> tuple[int, int, str]:
        tier, bucket = key
        return TIERS.index(tier), bucket_order.get(bucket or "", len(BUCKETS)), bucket or ""

    tier_rows = [report_row(tier, None, tiers[tier], slos[tier], duration_s) for tier in TIERS if tier in tiers]
    bucket_rows = [
        report_row(tier, bucket, buckets[tier, bucket], slos[tier], duration_s)
        for tier, bucket in sorted(buckets, key=bucket_key)
    ]
    return tier_rows, bucket_rows


def report_tables(rows: Sequence[ReportRow], title: str) -> tuple[Table, Table]:
    """Terminal tables of report rows, narrow enough for 80 columns: latencies (ms, a line per metric) and
    outcomes (429: rejected; SLO met: attainment; goodput: requests per second that met their SLO;
    tok/s: output tokens of completed requests per second)."""
    latency = Table(title=f"{title}: latency (ms)")
    for name in ("tier", "bucket", "metric"):
        latency.add_column(name)
    for name in ("n", "P50", "P90", "P99", "max"):
        latency.add_column(name, justify="right")
    outcomes = Table(title=f"{title}: outcomes")
    outcomes.add_column("tier", no_wrap=True, min_width=len("background"))
    outcomes.add_column("bucket")
    for name in ("n", "ok", "429", "err", "SLO met", "goodput", "tok/s"):
        outcomes.add_column(name, justify="right")
    for row in rows:
        bucket = row.bucket or "all"
        named = (("TTFT", row.ttft_ms), ("E2E", row.e2e_ms), ("TPOT", row.tpot_ms), ("gap", row.gap_ms))
        first = True
        for metric, summary in named:
            if summary is not None:
                values = (summary.p50, summary.p90, summary.p99, summary.max)
                group = (row.tier, bucket) if first else ("", "")
                latency.add_row(*group, metric, str(summary.count), *(_number(value) for value in values))
                first = False
        if first:  # nothing completed in this group
            latency.add_row(row.tier, bucket, "–", "0", "", "", "", "")
        latency.add_section()
        outcomes.add_row(
            row.tier,
            bucket,
            *(str(count) for count in (row.num_requests, row.num_ok, row.num_rejected, row.num_errors)),
            f"{row.attainment:.1%}",
            f"{row.goodput_rps:.2f}",
            _number(row.output_tokens_per_s),
        )
    return latency, outcomes


def _number(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"
