"""vllm bench serve's language: send times drawn as vLLM draws them (gamma gaps), and the result fields
with vLLM's names and definitions, checked against figures computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.loadgen import at_offsets, send_offsets
from bench.serve_result import good_requests, parse_goodput, peak_output, percentile_key, result_fields
from bench.stats import RequestRecord, Status
from bench.workloads import Arrival
from tailcut.errors import FatalError

# The names vLLM 0.32's `vllm bench serve --save-result` writes for a generation run (main_async and
# benchmark in vllm/benchmarks/serve.py), with --percentile-metrics ttft,tpot,itl,e2el and the default
# --metric-percentiles 99; tests/e2e/test_vllm_parity.py checks the same against vLLM's code itself.
VLLM_MEASURED = [
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")),
]


# --- send times ---


def gaps_of(offsets: list[float]) -> np.ndarray:
    return np.diff([0.0, *offsets])


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_mean_one_over_rate_and_cv_one_over_sqrt_burstiness(burstiness: float) -> None:
    rate = 8.0
    offsets = send_offsets(20_000, rate, burstiness=burstiness, seed=1)
    gaps = gaps_of(offsets)
    assert offsets[-1] == pytest.approx(20_000 / rate)  # vLLM rescales: the last is sent at N / rate
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.04)
    assert offsets[0] > 0 and all(gap >= 0 for gap in gaps)  # the first request waits one gap too, as in vLLM


def test_send_times_are_vllms_stream_for_the_same_seed() -> None:
    """vLLM: np.random.seed(seed), then one np.random.gamma(shape, scale) per request, cumulated, rescaled."""
    np.random.seed(7)
    drawn = np.cumsum([np.random.gamma(shape=0.5, scale=1 / (3.0 * 0.5)) for _ in range(50)])
    expected = drawn * (50 / 3.0 / drawn[-1])
    assert send_offsets(50, 3.0, burstiness=0.5, seed=7) == pytest.approx(list(expected), rel=1e-12)
    assert send_offsets(50, 3.0, burstiness=0.5, seed=8) != pytest.approx(list(expected))


def test_infinite_rate_or_burstiness() -> None:
    assert send_offsets(4, math.inf, burstiness=0.3) == [0.0] * 4
    assert send_offsets(4, 2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError):
        send_offsets(0, 1.0)
    with pytest.raises(ValueError):
        send_offsets(3, 1.0, burstiness=0)
    requests = [Arrival(index, 0.0, "normal", "t", 10, 5) for index in range(3)]
    assert [arrival.at_s for arrival in at_offsets(requests, [0.1, 0.2, 0.4])] == [0.1, 0.2, 0.4]


# --- result fields, by hand ---


def record(
    index: int,
    *,
    ttft_ms: float,
    e2e_ms: float,
    output_tokens: int,
    gaps_ms: list[float],
    prompt_tokens: int = 10,
    sent_s: float = 0.0,
    status: Status = "ok",
) -> RequestRecord:
    tpot = (e2e_ms - ttft_ms) / (output_tokens - 1) if output_tokens > 1 else None
    return RequestRecord(
        index=index,
        tier="normal",
        bucket="short",
        tenant="t",
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        sent_s=sent_s,
        ttft_ms=ttft_ms,
        e2e_ms=e2e_ms,
        tpot_ms=tpot,
        gaps_ms=gaps_ms,
        status=status,
        error=None if status == "ok" else "x",
    )


RECORDS = [
    # TPOT (e2e − ttft) / (n − 1): 20, 40, none (one token: 0 for goodput), 30
    record(0, ttft_ms=10, e2e_ms=50, output_tokens=3, gaps_ms=[20, 20], prompt_tokens=5, sent_s=0.0),
    record(1, ttft_ms=20, e2e_ms=100, output_tokens=3, gaps_ms=[30, 50], prompt_tokens=6, sent_s=0.5),
    record(2, ttft_ms=30, e2e_ms=30, output_tokens=1, gaps_ms=[], prompt_tokens=7, sent_s=1.2),
    record(3, ttft_ms=40, e2e_ms=130, output_tokens=4, gaps_ms=[30, 30, 30], prompt_tokens=8, sent_s=1.5),
    # failed: in `failed`, nowhere else
    record(4, ttft_ms=1, e2e_ms=1, output_tokens=9, gaps_ms=[1] * 8, prompt_tokens=100, status="error"),
    record(5, ttft_ms=1, e2e_ms=1, output_tokens=9, gaps_ms=[1] * 8, prompt_tokens=100, status="rejected"),
]


def test_counts_throughputs_and_each_metrics_statistics() -> None:
    fields = result_fields(RECORDS, duration_s=2.0)
    assert (fields["completed"], fields["failed"]) == (4, 2)
    assert (fields["total_input_tokens"], fields["total_output_tokens"]) == (26, 11)
    assert fields["request_throughput"] == pytest.approx(2.0)
    assert fields["output_throughput"] == pytest.approx(5.5)
    assert fields["total_token_throughput"] == pytest.approx(18.5)
    assert fields["request_goodput"] is None  # no --goodput
    # TTFT [10, 20, 30, 40]: population std sqrt(125); P99 by linear interpolation 30 + 0.97 × 10.
    assert fields["mean_ttft_ms"] == pytest.approx(25.0)
    assert fields["median_ttft_ms"] == pytest.approx(25.0)
    assert fields["std_ttft_ms"] == pytest.approx(math.sqrt(125))
    assert fields["p99_ttft_ms"] == pytest.approx(39.7)
    # TPOT over requests of 2+ tokens only: [20, 40, 30].
    assert fields["mean_tpot_ms"] == pytest.approx(30.0)
    assert fields["median_tpot_ms"] == pytest.approx(30.0)
    assert fields["p99_tpot_ms"] == pytest.approx(39.8)
    # ITL pooled: [20, 20, 30, 50, 30, 30, 30].
    assert fields["mean_itl_ms"] == pytest.approx(30.0)
    assert fields["median_itl_ms"] == pytest.approx(30.0)
    assert fields["p99_itl_ms"] == pytest.approx(48.8)
    # E2EL [50, 100, 30, 130].
    assert fields["mean_e2el_ms"] == pytest.approx(77.5)
    assert fields["median_e2el_ms"] == pytest.approx(75.0)
    assert fields["p99_e2el_ms"] == pytest.approx(100 + 0.97 * 30)


def test_goodput_counts_completed_requests_meeting_every_objective() -> None:
    assert good_requests(RECORDS, {"ttft": 20}) == 2  # 10 and 20: an objective met exactly counts
    assert good_requests(RECORDS, {"ttft": 19.99}) == 1
    # TPOT ≤ 25: request 0 (20) and the one-token request 2 (TPOT 0, as vLLM counts it).
    assert good_requests(RECORDS, {"tpot": 25}) == 2
    assert good_requests(RECORDS, {"ttft": 35, "e2el": 60}) == 2  # 0 (50) and 2 (30); not 1 (100)
    assert good_requests(RECORDS, {}) == 4
    fields = result_fields(RECORDS, duration_s=2.0, goodput={"ttft": 35, "e2el": 60})
    assert fields["request_goodput"] == pytest.approx(1.0)


def test_peak_second_counts_chunks_and_active_requests_as_vllm_does() -> None:
    # Token times from the first send: 0: 0.01, 0.03, 0.05 | 1: 0.52, 0.55, 0.60 | 2: 1.23 | 3: 1.54..1.63.
    assert peak_output(RECORDS) == (6.0, 2)  # second 0: six chunks, requests 0 and 1; second 1: five, 2 and 3
    assert peak_output([]) == (0.0, 0)


def test_no_values_report_zero_like_vllm_and_percentile_names() -> None:
    fields = result_fields([RECORDS[4]], duration_s=1.0, percentiles=(50, 99.9))
    assert fields["completed"] == 0 and fields["mean_ttft_ms"] == 0.0 and fields["p99.9_itl_ms"] == 0.0
    assert "p50_e2el_ms" in fields and "p99_ttft_ms" not in fields
    assert percentile_key("ttft", 99.0) == "p99_ttft_ms" and percentile_key("itl", 99.9) == "p99.9_itl_ms"
    with pytest.raises(ValueError):
        result_fields(RECORDS, duration_s=0.0)


def test_the_measured_fields_have_vllms_names_in_vllms_order() -> None:
    assert list(result_fields(RECORDS, duration_s=2.0, goodput={"ttft": 1})) == VLLM_MEASURED


def test_goodput_arguments_are_checked_as_vllm_checks_them() -> None:
    assert parse_goodput(["ttft:500", "e2el:2000", "tpot:50"]) == {"ttft": 500.0, "e2el": 2000.0, "tpot": 50.0}
    for bad, words in (
        ("itl:5", "unknown metric"),
        ("ttft", "KEY:VALUE"),
        ("ttft:fast", "KEY:VALUE"),
        ("e2el:-1", "0 or more"),
    ):
        with pytest.raises(FatalError, match=words):
            parse_goodput([bad])
