"""``tailcut bench live``: the pure parts (trace stretching, time conversion, agreement, the live stack's
settings) and one short run through the real pipeline (private Redis, API, one ``sim`` worker)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from api.settings import ApiSettings
from bench import live, live_compare, live_records
from bench.records import read_records
from bench.stats import RequestRecord
from bench.workloads import load_workload, poisson_trace
from queues.keys import TIERS, Tier
from tailcut.cli import main
from workers.breakers import BreakerConfig
from workers.degrade import DegradeConfig
from workers.engines.costmodel import PROFILES
from workers.settings import WorkerSettings

SEED_MIX = load_workload("seed-mix")
H100 = PROFILES["h100-llama3-8b"]


def setup(**changes: object) -> live_compare.LiveSetup:
    base = live_compare.LiveSetup(
        workload=SEED_MIX,
        cost=H100,
        load=0.9,
        duration_s=10.0,
        time_scale=8.0,
        seed=0,
        policies=live_compare.LIVE_POLICIES,
        model_dir=Path("/nonexistent"),
        log_dir=Path("/nonexistent"),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def record(
    index: int = 0,
    tier: Tier = "realtime",
    *,
    sent_s: float = 1.0,
    ttft_ms: float | None = 80.0,
    e2e_ms: float | None = 400.0,
    gaps_ms: list[float] | None = None,
    output_tokens: int = 5,
    status: str = "ok",
) -> RequestRecord:
    return RequestRecord(
        index=index,
        tier=tier,
        bucket="short",
        tenant="acme",
        prompt_tokens=30,
        output_tokens=output_tokens,
        sent_s=sent_s,
        ttft_ms=ttft_ms,
        e2e_ms=e2e_ms,
        tpot_ms=None if ttft_ms is None or e2e_ms is None else (e2e_ms - ttft_ms) / (output_tokens - 1),
        gaps_ms=[80.0] * (output_tokens - 1) if gaps_ms is None else gaps_ms,
        status=status,  # type: ignore[arg-type]
        error=None if status == "ok" else "timeout",
    )


def test_stretching_keeps_the_requests_and_their_order_and_multiplies_every_offset() -> None:
    trace = poisson_trace(SEED_MIX, 90.0, seed=3, duration_s=2.0)
    stretched = live_records.stretch(trace, 8.0)
    assert len(stretched) == len(trace) > 100
    for virtual, real in zip(trace, stretched, strict=True):
        assert real.at_s == pytest.approx(virtual.at_s * 8.0)
        assert replace(real, at_s=virtual.at_s) == virtual


def test_real_times_are_divided_by_the_time_scale_into_simulated_time() -> None:
    real = record(sent_s=16.0, ttft_ms=80.0, e2e_ms=400.0)
    simulated = live_records.to_simulated(real, 8.0)
    assert simulated.sent_s == 2.0
    assert simulated.ttft_ms == 10.0 and simulated.e2e_ms == 50.0
    assert simulated.tpot_ms == pytest.approx(real.tpot_ms / 8)  # type: ignore[operator]
    assert simulated.gaps_ms == [10.0] * 4
    assert (simulated.index, simulated.tier, simulated.output_tokens) == (real.index, real.tier, real.output_tokens)
    unfinished = live_records.to_simulated(record(ttft_ms=None, e2e_ms=None, gaps_ms=[], status="error"), 4.0)
    assert unfinished.ttft_ms is None and unfinished.e2e_ms is None and unfinished.tpot_ms is None


def test_tokens_in_the_window_come_from_the_chunk_times_and_merged_chunks_count_their_share() -> None:
    # Chunks at 1.1, 1.2, 1.3, 1.4, 1.5 s: three of five before 1.35 s.
    one_each = record(sent_s=1.0, ttft_ms=100.0, gaps_ms=[100.0] * 4, output_tokens=5)
    assert live_records.tokens_before(one_each, 1.35) == pytest.approx(3)
    assert live_records.tokens_before(one_each, 10.0) == 5
    assert live_records.tokens_before(one_each, 1.0) == 0
    # 10 tokens in 5 chunks (deltas merged): each chunk carries two.
    merged = replace(one_each, output_tokens=10)
    assert live_records.tokens_before(merged, 1.35) == pytest.approx(6)
    assert live_records.tokens_before(record(ttft_ms=None, e2e_ms=None, gaps_ms=[], status="error"), 10.0) == 0


@pytest.mark.parametrize(
    ("live_ratio", "virtual_ratio", "agree"),
    [
        (1.0, 1.0, True),
        (1.25, 1.0, True),
        (1.26, 1.0, False),
        (0.75, 1.0, True),
        (0.74, 1.0, False),
        (0.31, 0.4, True),
        (0.29, 0.4, False),
    ],
)
def test_ratios_agree_within_a_quarter_of_the_virtual_one(live_ratio: float, virtual_ratio: float, agree: bool) -> None:
    assert live_compare.agrees(live_ratio, virtual_ratio) is agree


def test_a_request_that_never_finished_counts_at_its_time_so_far_and_a_shed_one_not_at_all() -> None:
    records = [
        record(0, e2e_ms=300.0),
        record(1, sent_s=2.0, e2e_ms=None, status="error"),
        record(2, e2e_ms=None, status="rejected"),
    ]
    assert live_records.latencies_ms(records, "e2e_ms", end_s=5.0) == [300.0, 3000.0]


def test_a_client_stall_marks_the_requests_whose_first_token_it_awaited() -> None:
    # Sent at 1.0 s, first token at 1.08 s; a stall from 1.05 s blocking 45 ms (probe 10 ms + 35 ms late).
    awaited = record(0, sent_s=1.0, ttft_ms=80.0)
    after = record(1, sent_s=1.2, ttft_ms=80.0)  # sent after the stall ended
    before = record(2, sent_s=0.5, ttft_ms=80.0)  # had its first token before it began
    never = record(3, sent_s=1.0, ttft_ms=None, e2e_ms=None, gaps_ms=[], status="error")
    assert live_records.stalled_first_tokens([awaited, after, before, never], [(1.05, 35.0)]) == {0}
    assert live_records.stalled_first_tokens([awaited], []) == set()


def test_the_paired_delta_matches_requests_by_index() -> None:
    virtual = [record(0, e2e_ms=300.0), record(1, e2e_ms=500.0), record(2, "normal", e2e_ms=100.0)]
    mine = [record(1, e2e_ms=530.0), record(0, e2e_ms=310.0), record(2, "normal", e2e_ms=900.0)]
    delta = live_records.paired_delta_ms(mine, virtual, "e2e_ms", "realtime")
    assert delta is not None and delta.count == 2 and delta.max == pytest.approx(30.0)
    assert delta.p50 == pytest.approx(20.0)


@pytest.mark.parametrize("policy", live_compare.LIVE_POLICIES)
def test_the_live_worker_runs_the_virtual_runs_engine_and_scheduler_with_times_scaled(
    policy: live_compare.LivePolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = live.sim_config(policy, setup(), 90.0)
    for name, value in live.worker_env(config, 8.0).items():
        monkeypatch.setenv(name, value)
    settings = WorkerSettings()
    engine = settings.engine
    assert engine.kind == "sim" and engine.sim_time_scale == 8.0 and engine.sim_profile == H100.name
    assert engine.max_num_seqs == settings.num_running_max == config.max_num_seqs == 256
    assert engine.max_num_batched_tokens == config.max_num_batched_tokens
    assert engine.sim_kv_capacity_tokens == config.kv_capacity_tokens and engine.block_size == config.block_size
    assert settings.scheduler.prefetch >= config.max_num_seqs
    # The simulator's fifo runs vLLM's default (no prefill cap); tailcut the threshold it deploys.
    assert engine.long_prefill_token_threshold == (256 if policy == "tailcut" else 0)
    scheduler = settings.scheduler_config()
    assert scheduler.policy == policy
    if policy == "tailcut":
        virtual = config.scheduler
        scaled = replace(virtual.budget, slack_margin_ms=virtual.budget.slack_margin_ms * 8)
        kept = virtual.keep_alive
        keep_alive = replace(
            kept,
            ttl_ms=kept.ttl_ms * 8,
            min_period_ms=kept.min_period_ms * 8,
            allocation_windows_ms=tuple(window_ms * 8 for window_ms in kept.allocation_windows_ms),
        )
        assert scheduler == replace(
            virtual,
            budget=scaled,
            traffic_window_ms=virtual.traffic_window_ms * 8,
            backlog_drain_ms=virtual.backlog_drain_ms * 8,
            slow_step_window_ms=virtual.slow_step_window_ms * 8,
            keep_alive=keep_alive,
        )
    # The breakers and the heartbeat fallback judge real-time latencies: stretched by the time scale,
    # so the live run trips them where the same run at full speed would; the realtime breaker, which
    # the simulator does not model and which holds background back, never trips.
    breakers, defaults = settings.breaker_config(), BreakerConfig()
    assert breakers.realtime_over_ms == live.NEVER_SLOW_MS
    assert breakers.realtime_open_s == defaults.realtime_open_s * 8
    assert breakers.normal_p99_ms == defaults.normal_p99_ms * 8
    assert breakers.evaluate_interval_s == defaults.evaluate_interval_s * 8
    assert breakers.realtime_trip_count == defaults.realtime_trip_count  # counts are not times
    degrade = settings.degrade_config()
    assert degrade.realtime_heartbeat_ms == DegradeConfig().realtime_heartbeat_ms * 8
    assert degrade.normal_heartbeat_ms == DegradeConfig().normal_heartbeat_ms * 8


def test_the_live_api_scales_the_deadlines_and_sheds_only_for_tailcut(monkeypatch: pytest.MonkeyPatch) -> None:
    api = ApiSettings()
    for policy, shed in (("fifo", False), ("tailcut", True)):
        config = live.sim_config(policy, setup(), 90.0)  # type: ignore[arg-type]
        for name, value in live.api_env(config, api, 8.0).items():
            monkeypatch.setenv(name, value)
        scaled = ApiSettings()
        deadlines, scaled_deadlines = api.admission_config().deadlines, scaled.admission_config().deadlines
        for tier in TIERS:
            assert scaled_deadlines.of(tier) == pytest.approx(deadlines.of(tier) * 8)
        limits = scaled.admission_config().shed
        assert (limits.realtime, limits.normal, limits.background) == (
            (config.shed.realtime, config.shed.normal, config.shed.background) if shed and config.shed else (0, 0, 0)
        )


def test_the_worker_log_says_how_far_the_engine_ran_behind(tmp_path: Path) -> None:
    path = tmp_path / "worker.log"
    lines = [
        {"event": "engine_started", "level": "info"},
        {"event": "sim_behind", "level": "warning", "behind_share": 0.07},
        {"event": "request_final", "level": "info", "rid": "a"},
        {"event": "request_final", "level": "info", "rid": "b"},
        {"event": "request_preempted", "level": "info", "rid": "c"},
        {"event": "sim_stopped", "level": "info", "steps": 1234, "virtual_s": 35.2, "behind_ms": 812},
    ]
    path.write_text("not json\n" + "\n".join(json.dumps(line) for line in lines) + "\n[1, 2]\n")
    read = live_records.read_worker_log(path)
    assert read["sim_behind_warnings"] == 1 and read["max_behind_share"] == 0.07
    assert (read["behind_ms"], read["engine_steps"], read["engine_virtual_s"]) == (812, 1234, 35.2)
    assert read["outcomes"] == {"final": 2, "preempted": 1}
    assert read["warnings"] == 1
    assert live_records.read_worker_log(tmp_path / "missing.log")["behind_ms"] is None


def side(p99_ttft_ms: float, p99_e2e_ms: float, background_tokens_per_s: float) -> live_compare.Side:
    metrics = {"realtime": {"p99_ttft_ms": p99_ttft_ms, "p99_e2e_ms": p99_e2e_ms}}
    return live_compare.Side([], 1.0, 0.0, metrics | {"background_tokens_per_s": background_tokens_per_s}, {})


def test_the_ratios_are_tailcut_over_fifo_on_each_clock_and_checked_for_agreement() -> None:
    fifo = live_compare.PolicyResult("fifo", live=side(100.0, 1000.0, 6000.0), virtual=side(100.0, 1000.0, 6000.0))
    ours = live_compare.PolicyResult("tailcut", live=side(50.0, 900.0, 5900.0), virtual=side(35.0, 880.0, 5800.0))
    checks = {check.name: check for check in live_compare.ratio_checks([fifo, ours])}
    ttft = checks["realtime P99 TTFT, tailcut / fifo"]
    assert (ttft.live, ttft.virtual, ttft.agree) == (0.5, 0.35, False)
    assert ttft.off == pytest.approx(0.5 / 0.35 - 1)
    e2e = checks["realtime P99 E2E, tailcut / fifo"]
    assert (e2e.live, e2e.virtual, e2e.agree) == (0.9, 0.88, True)
    assert checks["background tok/s, tailcut / fifo"].agree
    assert live_compare.ratio_checks([ours]) == []


def test_replays_give_each_ratio_a_virtual_median_that_live_is_also_judged_against() -> None:
    fifo = live_compare.PolicyResult("fifo", live=side(100.0, 1000.0, 6000.0), virtual=side(100.0, 1000.0, 6000.0))
    ours = live_compare.PolicyResult("tailcut", live=side(42.0, 900.0, 5900.0), virtual=side(33.0, 880.0, 5800.0))
    replays = [
        {"fifo": side(fifo_ttft, 1000.0, 6000.0), "tailcut": side(ours_ttft, 880.0, 5800.0)}
        for fifo_ttft, ours_ttft in ((100.0, 36.0), (100.0, 38.0), (50.0, 17.0), (100.0, 31.0))
    ]
    checks = {check.name: check for check in live_compare.ratio_checks([fifo, ours], replays)}
    ttft = checks["realtime P99 TTFT, tailcut / fifo"]
    assert ttft.replays == pytest.approx((0.36, 0.38, 0.34, 0.31))
    assert ttft.virtual_median == pytest.approx(0.34)  # of 0.33 (the drawn trace) and the four replays
    assert not ttft.agree and ttft.agree_replays  # 0.42 / 0.33 = 1.27; 0.42 / 0.34 = 1.24
    without = {check.name: check for check in live_compare.ratio_checks([fifo, ours])}
    assert without["realtime P99 TTFT, tailcut / fifo"].virtual_median == pytest.approx(0.33)
    assert not without["realtime P99 TTFT, tailcut / fifo"].agree_replays


def test_a_jittered_trace_keeps_its_requests_each_a_bounded_time_later() -> None:
    trace = poisson_trace(SEED_MIX, 200.0, seed=0, duration_s=2.0)
    moved = live_records.jittered(trace, 1.0, seed=3)
    assert sorted(arrival.index for arrival in moved) == [arrival.index for arrival in trace]
    assert [arrival.at_s for arrival in moved] == sorted(arrival.at_s for arrival in moved)
    by_index = {arrival.index: arrival for arrival in moved}
    shifts = [by_index[arrival.index].at_s - arrival.at_s for arrival in trace]
    assert all(0.0 <= shift <= 0.001 for shift in shifts) and max(shifts) > 0.0009
    assert all(replace(by_index[arrival.index], at_s=arrival.at_s) == arrival for arrival in trace)
    assert live_records.jittered(trace, 1.0, seed=3) == moved != live_records.jittered(trace, 1.0, seed=4)


def test_a_short_run_through_the_real_pipeline_completes_every_request(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Short replies, so the run drains within a second of its arrivals; one policy (a stack starts in
    # seconds: both would double the test's time), tailcut's, whose worker settings are the richer.
    workload = {
        "name": "tiny-mix",
        "tiers": [
            {"tier": "realtime", "share": 0.7, "prompt_tokens": [20, 60], "output_tokens": [4, 12]},
            {"tier": "background", "share": 0.3, "prompt_tokens": [100, 300], "output_tokens": [16, 32]},
        ],
    }
    path = tmp_path / "tiny-mix.json"
    path.write_text(json.dumps(workload))
    out = tmp_path / "out"
    argv = ["bench", "live", "--workload", str(path), "--load", "0.08", "--duration", "0.5", "--time-scale", "2"]
    main([*argv, "--policies", "tailcut", "--model", str(tiny_model), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "did the live run keep up?" in printed and "where live differs from virtual" in printed
    report = orjson.loads((out / "live.json").read_bytes())
    assert report["simulated"] is True and "×2" in report["note"]
    assert report["time_scale"] == 2.0 and report["requests"] >= 5 and report["ratios"] == []
    (entry,) = report["policies"]
    assert entry["policy"] == "tailcut" and "records" not in entry  # the summary only: records go beside it
    rows = read_records(out / "live-records.jsonl")
    for clock in ("live", "virtual"):
        records = [row for row in rows if row["clock"] == clock]
        assert len(records) == report["requests"] and {row["policy"] for row in records} == {"tailcut"}
        assert all(row["status"] == "ok" for row in records), [row for row in records if row["status"] != "ok"]
        assert entry[clock]["realtime"]["p99_e2e_ms"] > 0 and entry[clock]["background_tokens_per_s"] > 0
    # Every live reply had all its tokens, and its times are simulated: divided by the scale, they are
    # close to the virtual clock's (undivided, they would be about twice as long).
    virtual = {row["index"]: row for row in rows if row["clock"] == "virtual"}
    for row in (row for row in rows if row["clock"] == "live"):
        assert row["output_tokens"] == virtual[row["index"]]["output_tokens"] == row["num_chunks"]
    assert entry["live"]["realtime"]["p50_e2e_ms"] < 1.6 * entry["virtual"]["realtime"]["p50_e2e_ms"]
    stats = entry["live"]["stats"]
    assert stats["worker"]["engine_steps"] > 0 and stats["worker"]["behind_ms"] is not None
    assert stats["send_lag_ms"]["count"] == report["requests"] and stats["client_stalls"]["count"] >= 0
    assert set(stats["cpu_s"]) == {"api", "worker", "redis", "client"} and stats["machine"]["busy_share"] > 0
    assert Path(stats["worker_log"]).is_file() and stats["worker"]["outcomes"]["final"] == report["requests"]
    assert (out / "live_cdf_e2e.png").stat().st_size > 0 and (out / "live_cdf_ttft.png").stat().st_size > 0
    # Both clocks wrote their engine's steps: every engine call added, and its first token, once.
    for clock in ("live", "virtual"):
        lines = [orjson.loads(line) for line in (out / f"tailcut-{clock}-steps.jsonl").read_bytes().splitlines()]
        added = [line["add"] for line in lines if "add" in line]
        firsts = [request_id for line in lines if "step_ms" in line for request_id in line["first"]]
        assert sorted(firsts) == sorted(added) and len(added) >= report["requests"]
