"""The status page's figures: Prometheus's quantile interpolation, the window over snapshots, SLO verdicts."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from api.metrics import SloTargets
from api.status import StatusWindow, histogram_quantile, read_totals, tier_figures


def test_the_quantile_is_interpolated_inside_the_bucket_that_holds_the_rank() -> None:
    # 100 observations: 50 up to 0.1 s, 40 in (0.1, 0.5], 10 in (0.5, 1].
    counts = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, math.inf: 100.0}
    assert histogram_quantile(0.5, counts) == pytest.approx(0.1)
    assert histogram_quantile(0.75, counts) == pytest.approx(0.1 + 0.4 * 25 / 40)
    assert histogram_quantile(0.99, counts) == pytest.approx(0.5 + 0.5 * 9 / 10)
    # The first bucket starts at 0; a rank in +Inf answers the highest finite bound, as Prometheus does.
    assert histogram_quantile(0.2, counts) == pytest.approx(0.1 * 20 / 50)
    assert histogram_quantile(0.99, {0.1: 0.0, 1.0: 0.0, math.inf: 5.0}) == 1.0
    assert histogram_quantile(0.99, {0.1: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.99, {}) is None


def test_slo_verdicts_follow_each_tiers_targets() -> None:
    slo = SloTargets(realtime_ttft_s=0.25, realtime_e2e_s=1.0, normal_ttft_s=1.0, normal_tpot_s=0.05)
    assert slo.met("realtime", ttft_s=0.2, e2e_s=0.9, output_tokens=30)
    assert not slo.met("realtime", ttft_s=0.3, e2e_s=0.9, output_tokens=30)
    assert not slo.met("realtime", ttft_s=0.2, e2e_s=1.1, output_tokens=30)
    # Normal: (E2E - TTFT) / (tokens - 1) per token after the first.
    assert slo.met("normal", ttft_s=0.5, e2e_s=0.5 + 99 * 0.05, output_tokens=100)
    assert not slo.met("normal", ttft_s=0.5, e2e_s=0.5 + 99 * 0.06, output_tokens=100)
    # Background has no latency target by default: finishing is meeting it; a target can be set.
    assert slo.met("background", ttft_s=50.0, e2e_s=3000.0, output_tokens=1000)
    assert not SloTargets(background_e2e_s=60).met("background", ttft_s=1, e2e_s=61, output_tokens=10)


def test_the_window_subtracts_the_oldest_snapshot_inside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    ttft = Histogram("tailcut_ttft_seconds", "", ["tier", "bucket"], buckets=(0.1, 1.0), registry=registry)
    slo = Counter("tailcut_slo_requests_total", "", ["tier", "result"], registry=registry)
    clock = [1000.0]
    monkeypatch.setattr("api.status.time.monotonic", lambda: clock[0])
    window = StatusWindow(registry, window_s=60)
    window._snapshots.append(read_totals(registry, clock[0]))
    # Old traffic: slow, missed.
    for _ in range(10):
        ttft.labels("realtime", "short").observe(0.8)
        slo.labels("realtime", "missed").inc()
    clock[0] += 30
    window._snapshots.append(read_totals(registry, clock[0]))
    clock[0] += 40  # the first snapshot is now outside the window: the second is the baseline
    for _ in range(4):
        ttft.labels("realtime", "medium").observe(0.05)  # summed over buckets
        slo.labels("realtime", "met").inc()
    totals, covered_s = window.figures()
    assert covered_s == pytest.approx(40)
    figures = tier_figures(totals, "realtime")
    assert figures["ttft_count"] == 4 and figures["met"] == 4 and figures["missed"] == 0
    assert figures["attainment"] == 1.0
    assert figures["ttft_p99_ms"] == pytest.approx(0.1 * 0.99 * 1000, abs=0.1)
    assert tier_figures(totals, "normal")["attainment"] is None
