"""The pure scheduler, one rule per test, with small request factories (no Redis, no engine)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from queues.keys import Bucket, Tier
from workers.budget import BudgetConfig, RealtimeProgress, article_budget, room_budget, slack_budget
from workers.fairshare import NEUTRAL_WEIGHT, DeficitRoundRobin, rtt_weight
from workers.policies import make_scheduler
from workers.scheduler import TailcutPolicy
from workers.scheduling import EngineView, SchedRequest, SchedulerConfig

_ids = itertools.count()


def make(
    tier: Tier = "normal",
    *,
    bucket: Bucket = "short",
    tenant: str = "t",
    arrival_ms: int = 0,
    prompt: int = 50,
    output: int = 32,
    deadline_ms: int = 10_000,
) -> SchedRequest:
    return SchedRequest(
        id=f"r{next(_ids)}",
        tier=tier,
        bucket=bucket,
        tenant=tenant,
        arrival_ms=arrival_ms,
        deadline_ms=deadline_ms,
        prompt_tokens=prompt,
        remaining_tokens=output,
    )


# The budget rule of the source article alone: no prefill chunking, no realtime reserve.
ARTICLE = SchedulerConfig(
    budget=BudgetConfig(rule="article", min_tokens=512), prefill_chunk_tokens=0, realtime_reserve_tokens=0
)


def roomy(slots: int = 100, kv: int = 1_000_000, **kwargs: object) -> EngineView:
    return EngineView(free_slots=slots, free_kv_tokens=kv, **kwargs)  # type: ignore[arg-type]


# --- 1. token budget -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_short", "budget"), [(0, 512), (1, 512), (8, 512), (9, 576), (20, 1280), (32, 2048), (33, 2048), (500, 2048)]
)
def test_article_budget_formula_at_its_edges(num_short: int, budget: int) -> None:
    assert article_budget(BudgetConfig(rule="article", min_tokens=512), num_short) == budget


def test_slack_budget_is_large_until_a_realtime_request_runs_out_of_slack() -> None:
    config = BudgetConfig(rule="slack", min_tokens=512, slack_margin_ms=100)
    relaxed = [RealtimeProgress(deadline_ms=5_000, remaining_tokens=10)]
    tight = [*relaxed, RealtimeProgress(deadline_ms=1_000, remaining_tokens=50)]
    assert slack_budget(config, [], now_ms=0, step_ms=20) == 2048
    assert slack_budget(config, relaxed, now_ms=0, step_ms=20) == 2048
    # 1000 - 50 * 20 = 0 ms of slack < 100 ms margin.
    assert slack_budget(config, tight, now_ms=0, step_ms=20) == 512


def test_admission_stops_when_the_budget_is_spent_short_bucket_first() -> None:
    scheduler = TailcutPolicy(ARTICLE)
    long_one = make("normal", bucket="long", prompt=400, arrival_ms=0)
    shorts = [make("normal", bucket="short", prompt=100, arrival_ms=1 + i, tenant=f"t{i}") for i in range(3)]
    scheduler.add(long_one)
    for request in shorts:
        scheduler.add(request)
    decision = scheduler.schedule(roomy(), now_ms=10)
    # Budget 512 (few shorts waiting): the first admission always may, then 100 + 100 + 100 = 300 fit,
    # and the 400-token prompt would exceed 512.
    assert decision.token_budget == 512
    assert [request.bucket for request in decision.admit].count("short") == 3
    assert long_one not in decision.admit
    assert scheduler.num_waiting == 1


def test_a_prompt_longer_than_the_budget_is_still_admitted_first_in_a_round() -> None:
    scheduler = TailcutPolicy(ARTICLE)
    huge = make("background", bucket="long", prompt=1800)
    scheduler.add(huge)
    assert scheduler.schedule(roomy(), now_ms=0).admit == [huge]


def test_room_budget_grows_with_the_running_decodes() -> None:
    config = BudgetConfig(rule="room", min_tokens=768)
    assert room_budget(config, num_short_waiting=0, num_running=0) == 768
    assert room_budget(config, num_short_waiting=0, num_running=200) == 968
    assert room_budget(config, num_short_waiting=20, num_running=200) == 200 + 1280
    assert room_budget(config, num_short_waiting=0, num_running=1500) == 2048  # the ceiling


def test_prompts_still_prefilling_take_one_chunk_of_every_round_until_their_first_token() -> None:
    config = SchedulerConfig(
        budget=BudgetConfig(rule="room", min_tokens=600), prefill_chunk_tokens=256, realtime_reserve_tokens=0
    )
    scheduler = TailcutPolicy(config)
    backgrounds = [make("background", bucket="long", prompt=1500, arrival_ms=i) for i in range(4)]
    for request in backgrounds:
        scheduler.add(request)
    # Room 600: two chunks of 256 fit, a third would not.
    assert scheduler.schedule(roomy(), now_ms=10).admit == backgrounds[:2]
    assert scheduler.schedule(roomy(), now_ms=20).admit == []
    scheduler.prefilled(backgrounds[0].id)
    # One prefill left in flight (256) and 2 decodes: the third chunk fits again, the fourth not.
    assert scheduler.schedule(roomy(), now_ms=30).admit == [backgrounds[2]]


def test_a_long_prompt_waits_for_an_engine_without_prefill_in_flight_when_it_does_not_fit() -> None:
    config = SchedulerConfig(
        budget=BudgetConfig(rule="article", min_tokens=512), prefill_chunk_tokens=0, realtime_reserve_tokens=0
    )
    scheduler = TailcutPolicy(config)
    first, second = make("background", prompt=1800, arrival_ms=0), make("background", prompt=1800, arrival_ms=1)
    scheduler.add(first)
    scheduler.add(second)
    assert scheduler.schedule(roomy(), now_ms=10).admit == [first]
    assert scheduler.schedule(roomy(), now_ms=20).admit == []  # `first` is still prefilling
    scheduler.prefilled(first.id)
    assert scheduler.schedule(roomy(), now_ms=30).admit == [second]


def test_the_realtime_reserve_is_left_free_by_lower_tiers_and_used_by_realtime() -> None:
    config = SchedulerConfig(
        budget=BudgetConfig(rule="article", min_tokens=600), prefill_chunk_tokens=256, realtime_reserve_tokens=200
    )
    scheduler = TailcutPolicy(config)
    normals = [make("normal", bucket="medium", prompt=300, arrival_ms=i, tenant=f"t{i}") for i in range(2)]
    for request in normals:
        scheduler.add(request)
    # 600 - 200 reserved: one chunk of 256 fits the lower tiers' 400, the second (512) does not.
    assert scheduler.schedule(roomy(), now_ms=10).admit == normals[:1]
    realtime = make("realtime", prompt=120, arrival_ms=20)
    scheduler.add(realtime)
    # 1 decode + 256 in flight + 120 = 377 <= 600: the reserve takes it at once.
    assert scheduler.schedule(roomy(), now_ms=21).admit == [realtime]


# --- 2. tier order and the cut-in limit --------------------------------------------------------


def test_exactly_three_cut_ins_then_one_lower_tier_admission() -> None:
    scheduler = TailcutPolicy(SchedulerConfig(max_cut_ins=3))
    background = make("background", arrival_ms=0)
    normal = make("normal", arrival_ms=1)
    realtime = [make("realtime", arrival_ms=10 + i) for i in range(6)]
    for request in [background, normal, *realtime]:
        scheduler.add(request)
    order = [request.id for request in scheduler.schedule(roomy(), now_ms=100).admit]
    expected = [realtime[0], realtime[1], realtime[2], background, realtime[3], realtime[4], realtime[5], normal]
    assert order == [request.id for request in expected]


def test_cut_in_limit_is_configurable() -> None:
    scheduler = TailcutPolicy(SchedulerConfig(max_cut_ins=1))
    background = make("background", arrival_ms=0)
    realtime = [make("realtime", arrival_ms=10 + i) for i in range(3)]
    for request in [background, *realtime]:
        scheduler.add(request)
    order = [request.id for request in scheduler.schedule(roomy(), now_ms=100).admit]
    assert order == [realtime[0].id, background.id, realtime[1].id, realtime[2].id]


def test_realtime_not_jumping_ahead_does_not_count_as_a_cut_in() -> None:
    scheduler = TailcutPolicy(SchedulerConfig(max_cut_ins=1))
    early = [make("realtime", arrival_ms=i) for i in range(3)]
    late_background = make("background", arrival_ms=50)
    for request in [*early, late_background]:
        scheduler.add(request)
    order = [request.id for request in scheduler.schedule(roomy(), now_ms=100).admit]
    assert order == [*(request.id for request in early), late_background.id]


def test_every_tier_moves_when_realtime_never_stops_arriving() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    background = make("background", arrival_ms=0)
    scheduler.add(background)
    admitted: list[str] = []
    for step in range(10):
        scheduler.add(make("realtime", arrival_ms=10 + step))
        admitted += [request.id for request in scheduler.schedule(roomy(slots=1), now_ms=100 + step).admit]
    assert background.id in admitted[:4]


# --- 3. normal-tier fair share ----------------------------------------------------------------


def test_rtt_weight_formula_and_clamp() -> None:
    assert rtt_weight(100, 100, min_weight=0.1, max_weight=10) == pytest.approx(1 / math.log(2))
    assert rtt_weight(100, 400, min_weight=0.1, max_weight=10) == pytest.approx(1 / math.log(1.25))
    assert rtt_weight(400, 100, min_weight=0.1, max_weight=10) == pytest.approx(1 / math.log(5))
    # Clamped: a flow suffering far more than average does not take everything.
    assert rtt_weight(1, 10_000, min_weight=0.1, max_weight=10) == 10
    assert rtt_weight(1_000_000, 1, min_weight=0.1, max_weight=10) == 0.1
    assert rtt_weight(0, 50, min_weight=0.1, max_weight=10) == NEUTRAL_WEIGHT


def test_fair_share_proportions_follow_the_weights_over_1000_rounds() -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 4.0}
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=100, weight=weights.__getitem__)
    for flow in weights:
        for index in range(2_000):
            drr.push(flow, f"{flow}{index}", cost=100)
    served = Counter(item[0] for item in (drr.pop() for _ in range(1_000)) if item)
    total = sum(weights.values())
    for flow, weight in weights.items():
        assert served[flow] == pytest.approx(1_000 * weight / total, rel=0.10)


def test_scheduler_fair_share_favours_the_tenant_with_the_worse_latency() -> None:
    scheduler = TailcutPolicy(SchedulerConfig(fair_quantum_tokens=100))
    scheduler.observe_wait("slow", 800)
    scheduler.observe_wait("fast", 100)
    for index in range(1_000):
        scheduler.add(make("normal", tenant="slow", arrival_ms=index, prompt=60, output=40))
        scheduler.add(make("normal", tenant="fast", arrival_ms=index, prompt=60, output=40))
    # Freeze the weights at their current values for the proportion check.
    expected = scheduler.weight("slow") / scheduler.weight("fast")
    scheduler.config = SchedulerConfig(fair_quantum_tokens=100, rtt_smoothing=0.0)
    counts: Counter[str] = Counter()
    for _round in range(1_000):
        for request in scheduler.schedule(roomy(slots=1), now_ms=0).admit:
            counts[request.tenant] += 1
            scheduler.finish(request.id)
    assert expected > 1
    assert counts["slow"] / counts["fast"] == pytest.approx(expected, rel=0.10)


# --- 4. preemptible background ---------------------------------------------------------------


def test_background_is_preempted_when_higher_tiers_wait_and_slots_are_short() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    old, new = make("background", arrival_ms=0), make("background", arrival_ms=5)
    scheduler.add(old)
    scheduler.add(new)
    assert scheduler.schedule(roomy(slots=2), now_ms=10).admit == [old, new]
    chat = make("realtime", arrival_ms=20)
    scheduler.add(chat)
    decision = scheduler.schedule(roomy(slots=0), now_ms=30)
    assert decision.admit == []
    assert decision.preempt == [new]  # the newest loses the least
    assert new.id not in scheduler.running


def test_no_preemption_while_capacity_suffices_or_for_other_policies() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    background = make("background")
    scheduler.add(background)
    scheduler.schedule(roomy(slots=1), now_ms=0)
    scheduler.add(make("realtime", arrival_ms=1))
    assert scheduler.schedule(roomy(slots=4), now_ms=2).preempt == []
    for policy in ("fifo", "vllm-priority"):
        plain = make_scheduler(SchedulerConfig(policy=policy))  # type: ignore[arg-type]
        plain.add(make("background"))
        plain.schedule(roomy(slots=1), now_ms=0)
        plain.add(make("realtime", arrival_ms=1))
        assert plain.schedule(roomy(slots=0), now_ms=2).preempt == []


def test_a_preempted_request_comes_back_as_a_continuation() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    background = make("background", prompt=100, output=600)
    scheduler.add(background)
    scheduler.schedule(roomy(slots=1), now_ms=0)
    scheduler.advance(background.id, 256)
    scheduler.add(make("realtime", arrival_ms=1))
    (victim,) = scheduler.schedule(roomy(slots=0), now_ms=2).preempt
    assert (victim.prompt_tokens, victim.remaining_tokens) == (356, 344)
    scheduler.add(victim)  # the worker re-queues it with the tokens generated so far
    assert victim in list(scheduler.waiting())


# --- 5. sliced decoding ----------------------------------------------------------------------


def test_slices_are_256_tokens_for_tailcut_and_whole_requests_otherwise() -> None:
    request = make("background", output=1000)
    assert TailcutPolicy(SchedulerConfig()).slice_limit(request) == 256
    assert make_scheduler(SchedulerConfig(policy="fifo")).slice_limit(request) == 1000
    scheduler = TailcutPolicy(SchedulerConfig())
    scheduler.add(request)
    scheduler.schedule(roomy(), now_ms=0)
    limits = []
    while request.remaining_tokens > 0:
        limit = scheduler.slice_limit(request)
        limits.append(limit)
        scheduler.advance(request.id, limit)
    assert limits == [256, 256, 256, 232]


def test_a_slice_boundary_yields_only_when_higher_tiers_wait_and_capacity_is_short() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    background = make("background", output=1000)
    scheduler.add(background)
    scheduler.schedule(roomy(slots=1), now_ms=0)
    # Nothing more urgent waits: continue, whatever the capacity.
    assert scheduler.at_slice_boundary(background.id, roomy(slots=0)) is False
    scheduler.add(make("realtime", arrival_ms=5))
    # Something waits but there is room for it: continue (a yield would only cost a re-prefill).
    assert scheduler.at_slice_boundary(background.id, roomy(slots=3)) is False
    # Something waits and there is no room: yield.
    assert scheduler.at_slice_boundary(background.id, roomy(slots=0)) is True
    assert background.id not in scheduler.running


def test_waiting_work_in_redis_counts_for_budget_and_yield() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    normal = make("normal", output=1000)
    scheduler.add(normal)
    scheduler.schedule(roomy(slots=1), now_ms=0)
    backlog = {("realtime", "short"): 40}
    assert scheduler.current_budget(roomy(backlog=backlog), now_ms=0) == 2048
    assert scheduler.at_slice_boundary(normal.id, roomy(slots=0, backlog={("background", "long"): 5})) is False
    assert scheduler.at_slice_boundary(normal.id, roomy(slots=0, backlog=backlog)) is True


# --- baselines ------------------------------------------------------------------------------


def test_fifo_admits_in_arrival_order_whatever_the_tier() -> None:
    scheduler = make_scheduler(SchedulerConfig(policy="fifo"))
    requests = [make("background", arrival_ms=0), make("realtime", arrival_ms=1), make("normal", arrival_ms=2)]
    for request in reversed(requests):
        scheduler.add(request)
    decision = scheduler.schedule(roomy(slots=2), now_ms=5)
    assert decision.admit == requests[:2]
    assert [scheduler.engine_priority(request) for request in requests] == [0, 0, 0]
    priority = make_scheduler(SchedulerConfig(policy="vllm-priority"))
    assert [priority.engine_priority(request) for request in requests] == [2, 0, 1]


def test_long_normal_work_is_bypassed_by_shorter_buckets_at_most_three_times_in_a_row() -> None:
    scheduler = TailcutPolicy(SchedulerConfig(max_cut_ins=3))
    long_one = make("normal", bucket="long", prompt=300, arrival_ms=0)
    scheduler.add(long_one)
    picks: list[str] = []
    for step in range(6):
        scheduler.add(make("normal", bucket="short", prompt=20, arrival_ms=1 + step, tenant=f"s{step}"))
        picks += [request.bucket for request in scheduler.schedule(roomy(slots=1), now_ms=10 + step).admit]
    assert picks[:4] == ["short", "short", "short", "long"]


def test_in_degrade_mode_no_background_enters_not_even_by_the_cut_in_rule() -> None:
    # Without the background gate, which would hold background while realtime is busier than usual.
    scheduler = TailcutPolicy(SchedulerConfig(max_cut_ins=1, background_gate_max_waiting=0))
    old_background = make("background", arrival_ms=0)
    scheduler.add(old_background)
    for step in range(3):
        scheduler.add(make("realtime", arrival_ms=10 + step))
    paused = EngineView(free_slots=10, free_kv_tokens=1 << 20, admit_background=False)
    admitted = [request.tier for request in scheduler.schedule(paused, now_ms=20).admit]
    assert admitted == ["realtime", "realtime", "realtime"]
    assert [request.id for request in scheduler.schedule(roomy(), now_ms=30).admit] == [old_background.id]
