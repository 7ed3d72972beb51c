"""Benchmark statistics: percentiles as numpy computes them, attainment and goodput per WORKLOADS.md."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench import plots
from bench.stats import (
    RequestRecord,
    attainment,
    by_tier,
    goodput_rps,
    output_tokens_per_s,
    report_rows,
    summarize,
)
from bench.workloads import Slo
from queues.keys import Tier

# E2E latencies (ms) recorded in a live run against the tiny model, in arrival order.
RECORDED_MS = [412.7, 388.1, 1290.4, 402.2, 455.9, 3021.5, 397.0, 441.3, 610.8, 389.9, 2875.2, 420.1, 405.6]

SEED_SLOS: dict[Tier, Slo] = {
    "realtime": Slo(ttft_ms=250, e2e_ms=1000),
    "normal": Slo(ttft_ms=1000, tpot_ms=50),
    "background": Slo(),
}


def record(
    index: int,
    tier: Tier = "realtime",
    *,
    ttft_ms: float | None = 100.0,
    e2e_ms: float | None = 500.0,
    tpot_ms: float | None = 10.0,
    output_tokens: int = 20,
    bucket: str | None = "short",
    status: str = "ok",
    gaps_ms: list[float] | None = None,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        tier=tier,
        bucket=bucket,
        tenant="acme",
        prompt_tokens=50,
        output_tokens=output_tokens,
        sent_s=index * 0.1,
        ttft_ms=ttft_ms,
        e2e_ms=e2e_ms,
        tpot_ms=tpot_ms,
        gaps_ms=gaps_ms or [],
        status=status,  # type: ignore[arg-type]
        error=None if status == "ok" else status,
    )


def test_summary_matches_numpy_on_recorded_latencies() -> None:
    summary = summarize(RECORDED_MS)
    assert summary is not None
    assert summary.count == len(RECORDED_MS)
    assert summary.mean == pytest.approx(np.mean(RECORDED_MS))
    for field, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert getattr(summary, field) == pytest.approx(np.percentile(RECORDED_MS, q))
    assert summary.max == np.max(RECORDED_MS)


def test_summary_by_hand() -> None:
    # Linear interpolation between closest ranks: rank q/100·(n−1) of the sorted values.
    summary = summarize([40.0, 10.0, 30.0, 20.0])
    assert summary is not None
    assert (summary.p50, summary.p90, summary.p99, summary.max, summary.mean) == pytest.approx(
        (25.0, 37.0, 39.7, 40.0, 25.0)
    )
    assert summarize([]) is None


def test_rows_group_by_tier_and_bucket() -> None:
    realtime = [record(i, e2e_ms=ms, bucket="short" if i % 2 else "medium") for i, ms in enumerate(RECORDED_MS)]
    background = [record(100 + i, "background", e2e_ms=5000.0 + i, bucket="long") for i in range(3)]
    tier_rows, bucket_rows = report_rows([*background, *realtime], SEED_SLOS, duration_s=10.0)

    assert [row.tier for row in tier_rows] == ["realtime", "background"]
    assert tier_rows[0].e2e_ms == summarize(RECORDED_MS)
    assert tier_rows[0].e2e_ms is not None and tier_rows[0].e2e_ms.p99 == pytest.approx(np.percentile(RECORDED_MS, 99))
    assert tier_rows[1].num_requests == 3 and tier_rows[1].e2e_ms is not None and tier_rows[1].e2e_ms.max == 5002.0
    assert [(row.tier, row.bucket) for row in bucket_rows] == [
        ("realtime", "short"),
        ("realtime", "medium"),
        ("background", "long"),
    ]
    short = [ms for i, ms in enumerate(RECORDED_MS) if i % 2]
    assert bucket_rows[0].e2e_ms is not None and bucket_rows[0].e2e_ms.p90 == pytest.approx(np.percentile(short, 90))
    assert by_tier([*background, *realtime], "e2e_ms") == {
        "realtime": RECORDED_MS,
        "background": [5000.0, 5001.0, 5002.0],
    }


def test_attainment_and_goodput_count_failures_as_misses() -> None:
    realtime = [
        record(0, ttft_ms=100, e2e_ms=900),  # met
        record(1, ttft_ms=300, e2e_ms=900),  # TTFT over 250 ms
        record(2, ttft_ms=100, e2e_ms=1200),  # E2E over 1 s
        record(3, ttft_ms=None, e2e_ms=None, tpot_ms=None, output_tokens=0, status="rejected"),  # shed (429)
    ]
    normal = [
        record(4, "normal", ttft_ms=900, e2e_ms=5000, tpot_ms=49),  # met
        record(5, "normal", ttft_ms=900, e2e_ms=9000, tpot_ms=60),  # TPOT over 50 ms
        record(6, "normal", ttft_ms=900, e2e_ms=900, tpot_ms=None, output_tokens=1),  # no TPOT: not checked
    ]
    background = [
        record(7, "background", ttft_ms=9000, e2e_ms=90000, tpot_ms=500, output_tokens=300),  # completes: met
        record(8, "background", ttft_ms=9000, e2e_ms=None, tpot_ms=None, output_tokens=40, status="error"),
    ]
    assert attainment(realtime, SEED_SLOS["realtime"]) == 0.25
    assert attainment(normal, SEED_SLOS["normal"]) == pytest.approx(2 / 3)
    assert attainment(background, SEED_SLOS["background"]) == 0.5
    everything = [*realtime, *normal, *background]
    assert goodput_rps(everything, SEED_SLOS, duration_s=2.0) == 2.0  # 4 met in 2 s
    # realtime 3·20, normal 20 + 20 + 1, background 300; the failed background request's 40 do not count.
    assert output_tokens_per_s(everything, duration_s=2.0) == pytest.approx((60 + 41 + 300) / 2)

    tier_rows, _ = report_rows(everything, SEED_SLOS, duration_s=2.0)
    realtime_row = tier_rows[0]
    assert (realtime_row.num_ok, realtime_row.num_rejected, realtime_row.num_errors) == (3, 1, 0)
    assert realtime_row.attainment == 0.25 and realtime_row.goodput_rps == 0.5
    assert realtime_row.ttft_ms is not None and realtime_row.ttft_ms.count == 3  # the rejected one has no TTFT


def test_gaps_are_pooled_over_completed_requests() -> None:
    records = [
        record(0, gaps_ms=[10.0, 20.0]),
        record(1, gaps_ms=[30.0]),
        record(2, gaps_ms=[999.0], status="error"),
    ]
    (row,), _ = report_rows(records, SEED_SLOS, duration_s=1.0)
    assert row.gap_ms == summarize([10.0, 20.0, 30.0])


def test_plots_write_pngs(tmp_path: Path) -> None:
    cdf = plots.plot_cdf(
        {"fifo": {"realtime": RECORDED_MS, "background": [5000.0]}, "tailcut": {"realtime": [400.0, 420.0]}},
        "E2E",
        tmp_path / "cdf.png",
        note="TEST (made-up numbers)",
    )
    p99 = plots.plot_p99_vs_load(
        [("fifo", 0.5, 900.0), ("fifo", 0.9, 1400.0), ("tailcut", 0.5, 850.0), ("tailcut", 0.9, 880.0)],
        tmp_path / "p99.png",
        note="TEST (made-up numbers)",
        floor_ms={0.5: 800.0, 0.9: 840.0},
    )
    for path in (cdf, p99):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
