"""The virtual-clock runs (SIMULATOR): the scheduler driving the sim engine, determinism, the physics floor."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import orjson
import pytest

from admission.shedding import ShedLimits
from bench.policies import Job, Variant, records_of, run_job
from bench.simrun import SimConfig, SimRun, fifo_capacity_rps, floor_e2e_ms, mean_step_us, simulate
from bench.workloads import load_workload, make_trace, poisson_trace
from workers.engines.costmodel import PROFILES
from workers.retention import KeepAliveConfig
from workers.scheduling import SchedulerConfig

H100 = PROFILES["h100-llama3-8b"]
SEED_MIX = load_workload("seed-mix")
ROOT = Path(__file__).parents[2]


def run(policy: str, rate_rps: float, duration_s: float = 10.0, seed: int = 0, **config: object) -> SimRun:
    trace = poisson_trace(SEED_MIX, rate_rps, seed=seed, duration_s=duration_s)
    return simulate(trace, SEED_MIX, SimConfig(policy=policy, cost=H100, **config), duration_s=duration_s)  # type: ignore[arg-type]


def fingerprint(result: SimRun) -> list[tuple[object, ...]]:
    return [(r.arrival.index, r.status, r.ttft_ms, r.e2e_ms, r.output_tokens) for r in result.records]


@pytest.mark.parametrize("policy", ["static-batch", "fifo", "vllm-priority", "tailcut"])
def test_every_request_completes_with_its_tokens_at_light_load(policy: str) -> None:
    result = run(policy, 20.0, static_batch_size=256)
    assert result.records, "the trace is empty"
    for record in result.records:
        assert record.status == "ok", record
        assert record.output_tokens == record.arrival.output_tokens
        assert record.ttft_ms is not None and record.e2e_ms is not None
        assert 0 < record.ttft_ms <= record.e2e_ms
        # No reply is faster than its prefill step plus one decode step per further token.
        assert record.e2e_ms * 1000 >= H100.step_us(0, 1) * (record.output_tokens - 1)


def test_the_same_seed_gives_the_same_run_and_another_seed_does_not() -> None:
    first, again = run("tailcut", 60.0), run("tailcut", 60.0)
    assert fingerprint(first) == fingerprint(again)
    assert first.num_steps == again.num_steps and first.window_output_tokens == again.window_output_tokens
    assert fingerprint(run("tailcut", 60.0, seed=1)) != fingerprint(first)


def test_a_run_is_identical_in_processes_with_different_hash_seeds() -> None:
    code = (
        "from tests.unit.test_simrun import run, fingerprint; import hashlib; "
        "print(hashlib.sha256(repr(fingerprint(run('tailcut', 60.0))).encode()).hexdigest())"
    )
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_tailcut_slices_and_requeues_through_the_scheduler() -> None:
    # Slices of 64 tokens: every background reply (256+ tokens) takes several engine calls, and each
    # continuation must carry on exactly where the previous slice stopped.
    result = run("tailcut", 60.0, scheduler=SchedulerConfig(slice_tokens=64))
    background = [r for r in result.records if r.arrival.tier == "background"]
    assert background and all(r.engine_calls >= r.arrival.output_tokens // 64 for r in background)
    assert all(r.output_tokens == r.arrival.output_tokens for r in result.records)


def test_the_simulated_engine_runs_with_the_prefill_chunk_the_tailcut_policy_asks_for() -> None:
    # As the worker does: the chunk the policy asks for is applied to the engine, and only then does
    # the policy adapt. seed-mix's realtime prompts are short: the chunk is half the budget floor.
    adaptive = run("tailcut", 60.0)
    assert adaptive.prefill_chunk_tokens == SchedulerConfig().budget.min_tokens // 2
    fixed = run("tailcut", 60.0, scheduler=SchedulerConfig(adaptive=False))
    assert fixed.prefill_chunk_tokens == SchedulerConfig().prefill_chunk_tokens
    assert fingerprint(fixed) != fingerprint(adaptive)
    assert run("fifo", 60.0).prefill_chunk_tokens is None  # a plain engine server keeps its own


def test_overload_sheds_background_first_and_keeps_queues_bounded() -> None:
    capacity = 101.0  # about fifo's saturation rate on seed-mix with the H100 profile
    shed = run("tailcut", 1.2 * capacity, duration_s=30.0, shed=ShedLimits())
    rejected = {
        tier: sum(r.status == "rejected" and r.arrival.tier == tier for r in shed.records)
        for tier in ("realtime", "background")
    }
    assert rejected["background"] > 0 and rejected["realtime"] == 0
    assert not [r for r in shed.records if r.status == "unfinished"]
    unbounded = run("fifo", 1.2 * capacity, duration_s=30.0, drain_s=5.0)
    assert [r for r in unbounded.records if r.status == "unfinished"], "fifo at 120% should still be queueing"


def test_fifo_capacity_is_the_completion_rate_of_a_saturated_engine() -> None:
    capacity = fifo_capacity_rps(SEED_MIX, H100, seed=0, num_requests=1500)
    # Mean request: 314 prompt and 160 output tokens; the cost model's ideal (every step full, no
    # base cost) bounds it from above.
    ideal = 1e6 / (
        H100.prefill_token_us * SEED_MIX.mean_prompt_tokens + H100.decode_seq_us * SEED_MIX.mean_output_tokens
    )
    assert 0.4 * ideal < capacity < ideal


def test_floor_follows_the_littles_law_step_time() -> None:
    rate = 90.0
    load = rate * (17.25 * SEED_MIX.mean_prompt_tokens + 6.00 * SEED_MIX.mean_output_tokens) / 1e6
    assert mean_step_us(SEED_MIX, H100, rate) == pytest.approx(5753 / (1 - load))
    step = 5753 / (1 - load)
    expected_ms = (max(step, H100.step_us(120, 0)) + (16 + 0.99 * 48 - 1) * step) / 1000
    assert floor_e2e_ms(SEED_MIX, H100, rate, "realtime") == pytest.approx(expected_ms)
    assert mean_step_us(SEED_MIX, H100, 1000.0) == float("inf")


def test_records_and_rows_follow_the_metric_definitions() -> None:
    job = Job(Variant("fifo", "fifo"), 0.5, 20.0, 0, 10.0, SEED_MIX, H100)
    result = run_job(job)
    records = records_of(run("fifo", 20.0))
    assert [asdict(r)["index"] for r in records] == sorted(r.index for r in records)
    for record in records:
        if record.output_tokens > 1:
            assert record.tpot_ms == pytest.approx((record.e2e_ms - record.ttft_ms) / (record.output_tokens - 1))  # type: ignore[operator]
    realtime = next(row for row in result.rows if row["tier"] == "realtime")
    assert realtime["rejected"] == 0 and realtime["attainment"] > 0.9
    assert realtime["p50_e2e_ms"] <= realtime["p99_e2e_ms"] <= realtime["max_e2e_ms"]


def test_bench_policies_writes_the_results_other_tools_read(tmp_path: Path) -> None:
    out = tmp_path / "policies"
    subprocess.run(
        [sys.executable, "-m", "tailcut.cli", "bench", "policies", "--duration", "4", "--loads", "0.9,1.0,1.2",
         "--jobs", "2", "--out", str(out)],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    results = orjson.loads((out / "results.json").read_bytes())
    assert results["simulated"] is True and results["cost_model"]["name"] == "h100-llama3-8b"
    required = {
        "policy", "load", "tier", "p50_ttft_ms", "p99_ttft_ms", "p50_e2e_ms", "p99_e2e_ms", "floor_e2e_ms",
        "attainment", "output_tokens_per_s", "offered_tokens_per_s", "rejected",
    }  # fmt: skip
    assert results["runs"] and all(required <= row.keys() for row in results["runs"])
    policies = {row["policy"] for row in results["runs"]}
    assert {"static-batch", "fifo", "vllm-priority", "tailcut"} <= policies
    assert {row["load"] for row in results["runs"]} == {0.9, 1.0, 1.2}
    assert [kv["kv_allocation"] for kv in results["kv"]] == ["static", "paged", "paged"]
    assert results["targets"] and all(isinstance(target["met"], bool) for target in results["targets"])
    for name in ("policies_cdf_e2e_90.png", "policies_p99_e2e_vs_load.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")


def test_the_prefix_keep_alive_keeps_chat_histories_cached_and_costs_nothing_without_them() -> None:
    # long-history's next turn comes 4-12 s after the last: longer than a freed block lives in the
    # engine's LRU at this load, unless tailcut touches it (workers.retention).
    workload = load_workload("long-history")
    trace = make_trace(workload, 50.0, seed=0, duration_s=30.0)

    def cached_share(scheduler: SchedulerConfig) -> tuple[float, SimRun]:
        result = simulate(trace, workload, SimConfig(policy="tailcut", cost=H100, scheduler=scheduler), duration_s=30.0)
        realtime = [r for r in result.records if r.arrival.tier == "realtime" and r.status == "ok"]
        assert all(r.output_tokens == r.arrival.output_tokens for r in realtime)
        return sum(r.cached_prompt_tokens for r in realtime) / sum(r.arrival.prompt_tokens for r in realtime), result

    kept_share, kept = cached_share(SchedulerConfig())
    off_share, off = cached_share(SchedulerConfig(keep_alive=KeepAliveConfig(ttl_ms=0)))
    assert kept.keep_alive is not None and kept.keep_alive.touches > 0 and kept.keep_alive.returns > 0
    assert off.keep_alive is None
    assert kept_share > off_share + 0.3, (kept_share, off_share)
    # seed-mix has no conversations: nothing is touched, and the run is the run without keep-alive.
    plain = run("tailcut", 60.0)
    assert plain.keep_alive is not None and plain.keep_alive.touches == 0
    assert fingerprint(plain) == fingerprint(
        run("tailcut", 60.0, scheduler=SchedulerConfig(keep_alive=KeepAliveConfig(ttl_ms=0)))
    )


@pytest.mark.parametrize(
    ("tiers", "left_out"),
    [
        (
            [{"tier": "background", "share": 1.0, "prompt_tokens": [512, 2048], "output_tokens": [64, 256], "slo": {}}],
            ("realtime", "normal", "429"),
        ),
        (
            [
                {"tier": "realtime", "share": 0.7, "prompt_tokens": [20, 120], "output_tokens": [16, 64],
                 "slo": {"ttft_ms": 250, "e2e_ms": 1000}},
                {"tier": "normal", "share": 0.3, "prompt_tokens": [128, 512], "output_tokens": [64, 256],
                 "slo": {"ttft_ms": 1000}},
            ],
            ("background", "429"),
        ),
        (
            # Lengths from the dataset and sessions: the workload's profile holds arrays (a job that came
            # back from its process was once compared with ``==`` and the run ended in a ValueError).
            [
                {"tier": "realtime", "share": 0.8, "prompt_tokens": [4, 400], "output_tokens": [4, 300],
                 "dataset": {"table": "sharegpt-smollm2"},
                 "sessions": {"turns": [1, 6], "turn_gap_s": [2, 6], "max_prompt_tokens": 3000},
                 "slo": {"ttft_ms": 250, "tpot_ms": 50}},
                {"tier": "background", "share": 0.2, "prompt_tokens": [512, 2048], "output_tokens": [64, 256]},
            ],
            ("normal",),
        ),
    ],
    ids=["background-only", "no-background", "dataset-sessions-without-normal"],
)  # fmt: skip
def test_bench_policies_runs_a_workload_without_some_tier_and_leaves_its_targets_out(
    tmp_path: Path, tiers: list[dict[str, object]], left_out: tuple[str, ...]
) -> None:
    """A workload file need not have every tier (a batch-only service, a chat service without
    background): its targets are those of the tiers it has, and the report and plots still come out."""
    workload = tmp_path / "mine.json"
    body = {"name": "mine", "description": "a test mix", "tenants": ["a"], "arrivals": {"process": "poisson"}}
    workload.write_bytes(orjson.dumps({**body, "tiers": tiers}))
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "tailcut.cli", "bench", "policies", "--workload", str(workload), "--duration", "4",
         "--loads", "0.9,1.0,1.2", "--jobs", "2", "--capacity-requests", "300", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    names = [target["name"] for target in orjson.loads((out / "results.json").read_bytes())["targets"]]
    assert "120%: tailcut requests still queued when the drain window ends" in names
    for word in left_out:
        assert not [name for name in names if word in name], names
    present = [tier["tier"] for tier in tiers]
    assert all(any(tier in name for name in names) for tier in present), names
    assert (out / "policies_p99_e2e_vs_load.png").read_bytes().startswith(b"\x89PNG")
