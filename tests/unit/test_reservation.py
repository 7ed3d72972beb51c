"""Predictive pre-allocation: what the scheduler counts of a request's KV per reservation mode, the record
of how reservations fared, the scheduler admitting by them, and the benchmark's output (SIMULATOR)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from admission.admitter import Admitter
from admission.config import AdmissionConfig
from admission.request import GenerationRequest, ServedModel, TokenPrompt
from bench import reservation as bench_reservation
from bench.simrun import SimConfig, simulate
from bench.workloads import load_workload, poisson_trace
from queues.keys import Tier
from queues.messages import SamplingOptions
from workers.capacity import engine_view
from workers.engines.costmodel import PROFILES
from workers.lifecycle import Continue, Finished, RequestLifecycle
from workers.metrics import reservation_families
from workers.policies import make_scheduler
from workers.reservation import ReservationRecord, verdict
from workers.scheduler import TailcutPolicy
from workers.scheduling import EngineView, KvReservation, SchedRequest, SchedulerConfig

MODES: tuple[KvReservation, ...] = ("none", "max", "predicted")
_ids = itertools.count()


def make(
    tier: Tier = "normal",
    *,
    prompt: int = 100,
    output: int = 1000,
    predicted: int | None = 40,
    arrival_ms: int = 0,
    tenant: str = "t",
) -> SchedRequest:
    return SchedRequest(
        id=f"r{next(_ids)}",
        tier=tier,
        bucket="short",
        tenant=tenant,
        arrival_ms=arrival_ms,
        deadline_ms=60_000,
        prompt_tokens=prompt,
        remaining_tokens=output,
        predicted_remaining_tokens=predicted,
    )


def config(mode: KvReservation, *, block: int = 16, slice_tokens: int = 256) -> SchedulerConfig:
    return SchedulerConfig(kv_reservation=mode, kv_block_tokens=block, slice_tokens=slice_tokens)


# --- what a reservation holds ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "kv_tokens"),
    [
        ("none", 112),  # the prompt's 100 tokens in 7 blocks of 16
        ("max", 368),  # 100 + one slice of 256 = 356, in 23 blocks
        ("predicted", 144),  # 100 + the 40 predicted = 140, in 9 blocks
    ],
)
def test_each_mode_reserves_the_prompt_and_its_share_of_output_in_whole_blocks(
    mode: KvReservation, kv_tokens: int
) -> None:
    request = make(prompt=100, output=1000, predicted=40)
    assert request.reserved_kv_tokens(config(mode)) == kv_tokens
    assert request.reserved_output_tokens(config(mode)) == kv_tokens - 100


def test_a_prediction_is_capped_by_the_slice_and_max_tokens_and_floored_at_a_block_once_outgrown() -> None:
    predicted = config("predicted")
    assert make(prompt=100, output=1000, predicted=2000).reserved_kv_tokens(predicted) == 368  # the slice
    assert make(prompt=100, output=30, predicted=100).reserved_kv_tokens(predicted) == 144  # max_tokens: 130
    assert make(prompt=100, output=1000, predicted=0).reserved_kv_tokens(predicted) == 128  # outgrown: 116
    assert make(prompt=100, output=1000, predicted=-50).reserved_kv_tokens(predicted) == 128
    assert make(prompt=100, output=8, predicted=-50).reserved_kv_tokens(predicted) == 112  # 108: max_tokens
    # No prediction: as under max.
    assert make(prompt=100, predicted=None).reserved_kv_tokens(predicted) == 368
    # A block of one token: no rounding.
    assert make(prompt=100, predicted=40).reserved_kv_tokens(config("predicted", block=1)) == 140
    assert make(prompt=100, predicted=40).reserved_kv_tokens(config("max", block=1)) == 356
    # The CPU engine's blocks of 32.
    assert make(prompt=100, predicted=40).reserved_kv_tokens(config("predicted", block=32)) == 160


def test_the_prediction_comes_from_the_message_and_shrinks_as_output_is_generated() -> None:
    admitter = Admitter(AdmissionConfig(), ServedModel("m", 4096))
    request = GenerationRequest(
        prompt=TokenPrompt(list(range(1, 51))),
        reply_to="api",
        tier="realtime",
        max_tokens=500,
        sampling=SamplingOptions(),
    )
    message = admitter.admit_tokens(request, request_id="r", at_ms=0)
    sched = SchedRequest.of(message)
    assert sched.predicted_remaining_tokens == message.predicted_output_tokens == 64  # the realtime prior
    scheduler = TailcutPolicy(config("predicted"))
    scheduler.add(sched)
    scheduler.schedule(EngineView(free_slots=1, free_kv_tokens=1 << 20), now_ms=0)
    scheduler.advance(sched.id, 70)
    assert (sched.prompt_tokens, sched.remaining_tokens, sched.predicted_remaining_tokens) == (120, 430, -6)
    message.generated_token_ids = list(range(70))
    continuation = SchedRequest.of(message)
    assert (continuation.prompt_tokens, continuation.predicted_remaining_tokens) == (120, -6)


# --- the record ------------------------------------------------------------------------------


def test_a_call_is_short_wasteful_or_exact() -> None:
    assert verdict(reserved_tokens=44, produced_tokens=45, block_size=16) == "short"
    assert verdict(reserved_tokens=44, produced_tokens=29, block_size=16) == "exact"  # 15 unused: no whole block
    assert verdict(reserved_tokens=44, produced_tokens=28, block_size=16) == "wasteful"  # 16 unused
    assert verdict(reserved_tokens=44, produced_tokens=44, block_size=16) == "exact"
    assert verdict(reserved_tokens=44, produced_tokens=28, block_size=32) == "exact"


def test_the_record_counts_verdicts_and_token_totals() -> None:
    record = ReservationRecord()
    for reserved, produced in ((44, 50), (44, 40), (268, 30), (12, 12)):
        record.observe(reserved, produced, 16)
    assert (record.num_calls, record.num_short, record.num_wasteful, record.num_exact) == (4, 1, 1, 2)
    assert (record.reserved_tokens, record.produced_tokens) == (368, 132)
    assert (record.unused_tokens, record.overrun_tokens) == (4 + 238, 6)
    assert record.share("short") == 0.25 and record.unused_tokens_per_call == 242 / 4
    assert record.as_dict()["exact"] == 2
    assert ReservationRecord().share("short") == 0.0


def test_under_none_a_call_is_short_once_it_outgrows_the_prompts_last_block() -> None:
    record = ReservationRecord()
    none = config("none")
    request = make(prompt=100)  # 12 slots left in its seventh block
    for produced in (12, 13, 256):
        record.observe(request.reserved_output_tokens(none), produced, none.kv_block_tokens)
    assert (record.num_exact, record.num_short) == (1, 2)


def test_the_lifecycle_records_each_ended_call_before_the_request_advances() -> None:
    admitter = Admitter(AdmissionConfig(), ServedModel("m", 4096))
    request = GenerationRequest(
        prompt=TokenPrompt(list(range(1, 21))), reply_to="api", tier="background", max_tokens=600
    )
    message = admitter.admit_tokens(request, request_id="r", at_ms=0)
    assert message.predicted_output_tokens == 600  # the background prior of 1024, capped at max_tokens
    scheduler = TailcutPolicy(config("predicted"))
    scheduler.add(SchedRequest.of(message))
    (admitted,) = scheduler.schedule(EngineView(free_slots=1, free_kv_tokens=1 << 20), now_ms=0).admit
    record = ReservationRecord()
    life = RequestLifecycle(message, admitted, scheduler, reservations=record)
    call = life.next_call()
    roomy = EngineView(free_slots=1, free_kv_tokens=1 << 20)
    produced = []
    while True:
        for token in range(call.sampling.max_tokens):
            life.on_output([token], "")
        produced.append(call.sampling.max_tokens)
        outcome = life.end_call("length", lambda: roomy)
        if isinstance(outcome, Finished):
            break
        assert isinstance(outcome, Continue)
        call = outcome.call
    assert produced == [256, 256, 88]
    # Each slice as the scheduler counted it when the call started: 20 + 256 → 288, 276 + 256 → 544 and
    # 532 + the 88 still predicted → 624 slots in blocks of 16; each left less than a block unused.
    assert (record.num_calls, record.num_short, record.num_wasteful, record.produced_tokens) == (3, 0, 0, 600)
    assert record.reserved_tokens == (288 - 20) + (544 - 276) + (624 - 532)


# --- the scheduler admits by the reservation --------------------------------------------------


def admitted_per_mode(kv_tokens: int = 3_000) -> dict[KvReservation, int]:
    """Requests one round admits into an engine with ``kv_tokens`` free, per mode: the same 30 requests
    (prompt 20, max_tokens 1000, predicted 100; their prompts fit the round's token budget) each time."""
    counts: dict[KvReservation, int] = {}
    for mode in MODES:
        scheduler = TailcutPolicy(config(mode))
        for index in range(30):
            scheduler.add(make("normal", prompt=20, output=1000, predicted=100, arrival_ms=index, tenant=f"t{index}"))
        decision = scheduler.schedule(EngineView(free_slots=100, free_kv_tokens=kv_tokens), now_ms=100)
        counts[mode] = len(decision.admit)
    return counts


def check_max_admits_fewer_than_predicted_than_none(counts: dict[KvReservation, int]) -> None:
    assert counts["max"] < counts["predicted"] < counts["none"], counts


def test_max_admits_fewer_than_predicted_which_admits_fewer_than_none_when_kv_binds() -> None:
    counts = admitted_per_mode()
    # 3,000 tokens: 288 each under max (10), 128 under predicted (23), 32 under none (all 30).
    assert counts == {"max": 10, "predicted": 23, "none": 30}
    check_max_admits_fewer_than_predicted_than_none(counts)
    # With room for everyone the modes agree.
    assert set(admitted_per_mode(kv_tokens=1 << 20).values()) == {30}


def test_the_ordering_check_fails_when_the_mode_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The property test is not vacuous: a reservation that ignores the mode breaks it."""

    def as_before(self: SchedRequest, config: SchedulerConfig) -> int:
        return self.prompt_tokens + min(self.remaining_tokens, config.slice_tokens)

    monkeypatch.setattr(SchedRequest, "reserved_kv_tokens", as_before)
    with pytest.raises(AssertionError):
        check_max_admits_fewer_than_predicted_than_none(admitted_per_mode())


def test_the_engine_view_counts_the_running_requests_reservations() -> None:
    for mode, reserved in (("none", 112), ("max", 368), ("predicted", 144)):
        scheduler = TailcutPolicy(config(mode))  # type: ignore[arg-type]
        for index in range(3):
            scheduler.add(make("normal", arrival_ms=index, tenant=f"t{index}"))
        scheduler.schedule(EngineView(free_slots=3, free_kv_tokens=1 << 20), now_ms=10)
        view = engine_view(scheduler, max_running=10, kv_capacity_tokens=10_000, backlog={}, step_ms=20.0)
        assert view.free_kv_tokens == 10_000 - 3 * reserved, mode


def test_the_engine_view_charges_no_reservation_to_a_policy_that_admits_by_slots_alone() -> None:
    """fifo and vllm-priority never read the free KV (a plain server leaves it to the engine): their
    view is not summed over what they handed the engine, however much that is."""
    for policy in ("fifo", "vllm-priority"):
        scheduler = make_scheduler(replace(config("max"), policy=policy))  # type: ignore[arg-type]
        assert not scheduler.admits_by_kv
        for index in range(3):
            scheduler.add(make("normal", arrival_ms=index))
        scheduler.schedule(EngineView(free_slots=3, free_kv_tokens=0), now_ms=10)
        assert len(scheduler.running) == 3  # admitted with no free KV at all
        view = engine_view(scheduler, max_running=10, kv_capacity_tokens=10_000, backlog={}, step_ms=20.0)
        assert (view.free_slots, view.free_kv_tokens) == (7, 10_000), policy
    assert TailcutPolicy(config("max")).admits_by_kv


def test_preemption_frees_what_the_waiting_requests_reserve() -> None:
    """Two background requests hold the KV; a waiting realtime request preempts one of them only when
    its own reservation does not fit what theirs leave."""
    outcome = {}
    for mode in MODES:
        scheduler = TailcutPolicy(config(mode))
        for index in range(2):
            scheduler.add(make("background", prompt=1000, output=1000, predicted=300, arrival_ms=index))
        scheduler.schedule(EngineView(free_slots=2, free_kv_tokens=1 << 20), now_ms=10)
        scheduler.add(make("realtime", prompt=200, output=64, predicted=30, arrival_ms=20))
        capacity = 2 * make("background", prompt=1000, output=1000, predicted=300).reserved_kv_tokens(config(mode))
        view = engine_view(scheduler, max_running=10, kv_capacity_tokens=capacity + 250, backlog={}, step_ms=20.0)
        outcome[mode] = len(scheduler.schedule(view, now_ms=30).preempt)
    # The chat reserves 208 (none), 272 (max: 264) and 240 (predicted: 230) of the 250 left.
    assert outcome == {"none": 0, "max": 1, "predicted": 0}


# --- the simulator feeds the record, and the benchmark reports every mode ------------------------


def test_the_simulator_records_every_ended_call_and_none_over_admits_when_kv_binds() -> None:
    workload = load_workload("seed-mix")
    trace = poisson_trace(workload, 40.0, seed=0, duration_s=5.0)
    runs = {}
    for mode in MODES:
        sim = SimConfig(
            policy="tailcut",
            cost=PROFILES["h100-llama3-8b"],
            scheduler=SchedulerConfig(kv_reservation=mode),
            kv_capacity_tokens=20_000,
            max_tokens="tier-cap",
        )
        runs[mode] = simulate(trace, workload, sim, duration_s=5.0)
    for mode, run in runs.items():
        assert all(record.status == "ok" for record in run.records), mode
        # Every call that ended, not those the scheduler aborted (preempted background).
        calls = sum(record.engine_calls for record in run.records)
        assert run.reservations.num_calls == calls - run.num_preempted, mode
        assert run.reservations.produced_tokens <= sum(record.output_tokens for record in run.records), mode
    assert runs["max"].reservations.num_short == 0
    assert runs["none"].reservations.share("short") > 0.9
    # Counting the prompt alone lets in more than the cache holds: the engine preempts (recomputes).
    # (Not never under max: a request that goes on into its next slice is not checked again.)
    engine_preempted = {mode: run.num_engine_preempted for mode, run in runs.items()}
    assert engine_preempted["none"] > 5 * max(engine_preempted["max"], engine_preempted["predicted"]), engine_preempted
    assert runs["none"].kv.max_running > runs["max"].kv.max_running


def test_the_benchmark_writes_every_mode_at_every_load(tmp_path: Path) -> None:
    workload = load_workload("seed-mix")
    cost = PROFILES["h100-llama3-8b"]
    report = bench_reservation.run(
        workload,
        cost,
        seed=0,
        duration_s=2.0,
        loads=(1.0,),
        kv_caches={"small": 30_000},
        jobs=1,
        capacity_requests=200,
    )
    path = bench_reservation.write(report, tmp_path, note=bench_reservation.note(cost), command=["test"])
    results = orjson.loads(path.read_bytes())
    assert results["simulated"] is True and "SIMULATOR" in results["note"]
    assert {row["mode"] for row in results["rows"]} == set(MODES) == set(results["modes"])
    for row in results["rows"]:
        assert row["kv_cache"] == "small" and row["load"] == 1.0 and row["calls"] > 0
        for key in ("short_share", "wasteful_share", "unused_tokens_per_call", "engine_preempted"):
            assert key in row
        assert row["realtime_p99_ttft_ms"] is not None and row["output_tokens_per_s"] > 0


# --- the worker's metrics ----------------------------------------------------------------------


def test_the_worker_exports_the_record() -> None:
    record = ReservationRecord()
    record.observe(44, 50, 16)
    record.observe(268, 30, 16)
    samples = {
        (sample.name, sample.labels.get("outcome")): sample.value
        for family in reservation_families(record, {"worker": "w"})
        for sample in family.samples
    }
    assert samples[("tailcut_worker_kv_reservations_total", "short")] == 1
    assert samples[("tailcut_worker_kv_reservations_total", "wasteful")] == 1
    assert samples[("tailcut_worker_kv_reservations_total", "exact")] == 0
    assert samples[("tailcut_worker_kv_reservation_reserved_tokens_total", None)] == 312
    assert samples[("tailcut_worker_kv_reservation_produced_tokens_total", None)] == 80
    assert samples[("tailcut_worker_kv_reservation_unused_tokens_total", None)] == 238
