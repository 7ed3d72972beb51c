"""The sizes tailcut adapts from what a worker sees: the prompt lengths and the realtime slack (pure)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from queues.keys import Bucket, Tier
from workers.budget import BudgetConfig, PromptLengths
from workers.engines.costmodel import PROFILES
from workers.engines.sim import SimEngine
from workers.scheduler import Room, Spent, TailcutPolicy
from workers.scheduling import EngineView, SchedRequest, SchedulerConfig

_ids = itertools.count()


def make(
    tier: Tier = "normal",
    *,
    prompt: int = 50,
    output: int = 32,
    bucket: Bucket = "medium",
    tenant: str = "t",
    arrival_ms: int = 0,
    deadline_ms: int = 10_000,
) -> SchedRequest:
    return SchedRequest(
        id=f"a{next(_ids)}",
        tier=tier,
        bucket=bucket,
        tenant=tenant,
        arrival_ms=arrival_ms,
        deadline_ms=deadline_ms,
        prompt_tokens=prompt,
        remaining_tokens=output,
    )


def roomy(kv: int = 1_000_000, **kwargs: object) -> EngineView:
    return EngineView(free_slots=256, free_kv_tokens=kv, **kwargs)  # type: ignore[arg-type]


def seen(scheduler: TailcutPolicy, tier: Tier, prompts: list[int]) -> None:
    """Let ``scheduler`` see (admit and finish) requests of ``tier`` with these prompt lengths."""
    for prompt in prompts:
        request = make(tier, prompt=prompt)
        scheduler.add(request)
        scheduler.schedule(roomy(), now_ms=0)
        scheduler.finish(request.id)


def chat_running(scheduler: TailcutPolicy, *, step_ms: float = 20.0) -> SchedRequest:
    """A realtime reply decoding from now on: the realtime tier is sending, so the rules that keep the
    steps short for it act (``TailcutPolicy.realtime_quiet``)."""
    chat = make("realtime", prompt=50, output=1_000_000)
    scheduler.add(chat)
    scheduler.schedule(roomy(step_ms=step_ms), now_ms=0)
    scheduler.prefilled(chat.id)
    return chat


def test_prompt_lengths_follow_a_high_quantile_of_the_recent_prompts() -> None:
    lengths = PromptLengths(window=100, quantile=0.99, grain=16)
    assert lengths.size() is None  # nothing seen: no estimate
    for prompt in range(201, 601, 4):  # 100 prompts, 201 ... 597
        lengths.observe(prompt)
    assert lengths.size() == 608  # the 99th of 100 (593) in whole blocks of 16
    for prompt in range(21, 121):  # the window moves on to short prompts
        lengths.observe(prompt)
    assert lengths.size() == 128


def test_prompt_lengths_grow_at_once_and_shrink_only_by_a_whole_step() -> None:
    lengths = PromptLengths(window=8, quantile=1.0, grain=16, min_samples=1, shrink_tokens=64)
    lengths.observe(300)
    assert lengths.size() == 304
    for _ in range(8):
        lengths.observe(260)  # 272 in blocks: less than 64 below 304, kept
    assert lengths.size() == 304
    for _ in range(8):
        lengths.observe(240)  # 240: a whole 64 below, followed
    assert lengths.size() == 240
    lengths.observe(250)
    assert lengths.size() == 256  # up at once


def test_the_chunk_and_the_reserve_follow_the_realtime_prompts_seen() -> None:
    config = SchedulerConfig(
        budget=BudgetConfig(min_tokens=256), prefill_chunk_tokens=256, realtime_reserve_tokens=256, prompt_window=64
    )
    scheduler = TailcutPolicy(config)
    seen(scheduler, "realtime", [500] * 64)
    decision = scheduler.schedule(roomy(), now_ms=0)
    assert decision.prefill_chunk_tokens == 512  # what the engine is asked for
    # Until the driver applied it, the scheduler counts with the chunk in force, and the reserve is
    # one chunk at most (a longer prompt takes two steps whatever it leaves).
    assert scheduler.realtime_reserve_tokens == 256
    scheduler.prefill_chunk_applied(512)
    assert scheduler.realtime_reserve_tokens == 512
    seen(scheduler, "realtime", [80] * 64)
    # Short prompts again: back to the configured sizes, never below them.
    assert (scheduler.prefill_chunk_tokens, scheduler.realtime_reserve_tokens) == (256, 256)
    # Continuations are not a client's prompts: they do not move the estimate.
    for _ in range(64):
        scheduler.add(replace(make("realtime", prompt=900), continuation=True))
    assert scheduler.prefill_chunk_tokens == 256


def test_what_the_prefix_cache_serves_does_not_count() -> None:
    config = SchedulerConfig(budget=BudgetConfig(min_tokens=256), prefill_chunk_tokens=16, prompt_window=64)
    scheduler = TailcutPolicy(config)
    for _ in range(400):  # chat turns whose history (3/4 of the prompt) the engine had cached
        turn = make("realtime", prompt=800)
        scheduler.add(turn)
        scheduler.schedule(roomy(), now_ms=0)
        scheduler.prompt_cached(turn.id, 600)
        scheduler.finish(turn.id)
    # A quarter of 800, in blocks of 16 (coming down from 800, it stops within 64 tokens of 200).
    assert 200 <= scheduler.prefill_chunk_tokens <= 256


def test_a_worker_starting_on_cached_chat_turns_learns_the_share_from_the_first_turns() -> None:
    config = SchedulerConfig(budget=BudgetConfig(min_tokens=256), prefill_chunk_tokens=16, prompt_window=64)
    scheduler = TailcutPolicy(config)
    for _ in range(16):  # a worker's first chat turns, whose history (3/4) the engine had cached
        turn = make("realtime", prompt=800)
        scheduler.add(turn)
        scheduler.schedule(roomy(), now_ms=0)
        scheduler.prompt_cached(turn.id, 600)
        scheduler.finish(turn.id)
    # The first turns, seen before any share was known, do not keep the chunk at whole histories.
    assert scheduler.prefill_chunk_tokens == 208  # 200 in blocks of 16


def test_prompt_lengths_scale_the_whole_window() -> None:
    lengths = PromptLengths(window=8, quantile=1.0, grain=16, min_samples=1, shrink_tokens=64)
    lengths.observe(800)
    assert lengths.size() == 800
    lengths.observe(800, scale=0.25)  # the share computed of every prompt seen, not of the last one
    assert lengths.size() == 208


def test_the_chunk_is_at_least_half_the_budget_floor_at_most_half_the_ceiling() -> None:
    config = SchedulerConfig(budget=BudgetConfig(min_tokens=1024, max_tokens=2048), prompt_window=16)
    scheduler = TailcutPolicy(config)
    seen(scheduler, "realtime", [60] * 16)
    assert scheduler.prefill_chunk_tokens == 512
    seen(scheduler, "realtime", [1800] * 16)
    assert scheduler.prefill_chunk_tokens == 1024
    uncapped = TailcutPolicy(SchedulerConfig(prefill_chunk_tokens=0, prompt_window=16))
    seen(uncapped, "realtime", [1800] * 16)
    assert uncapped.prefill_chunk_tokens == 0  # no chunking stays off


def test_without_adapting_the_configured_sizes_hold() -> None:
    scheduler = TailcutPolicy(SchedulerConfig(adaptive=False))
    seen(scheduler, "realtime", [500] * 64)
    assert (scheduler.prefill_chunk_tokens, scheduler.realtime_reserve_tokens) == (256, 256)
    assert scheduler.schedule(roomy(), now_ms=0).prefill_chunk_tokens == 256


def _engine_runs(scheduler: TailcutPolicy, engine: SimEngine, now_ms: int) -> list[SchedRequest]:
    """One round carried out on the simulated engine, as the worker and the simulator do."""
    decision = scheduler.schedule(roomy(), now_ms=now_ms)
    if decision.token_budget is not None:
        engine.set_token_budget(decision.token_budget)
    if decision.prefill_chunk_tokens is not None:
        scheduler.prefill_chunk_applied(engine.set_prefill_chunk(decision.prefill_chunk_tokens))
    for request in decision.admit:
        priority = 1 if request.tier == "realtime" else 3
        engine.add(request.id, request.prompt_tokens, request.remaining_tokens, priority=priority)
    return decision.admit


def test_a_realtime_prompt_that_fits_the_budget_is_prefilled_whole_in_one_step() -> None:
    scheduler = TailcutPolicy(SchedulerConfig(prompt_window=64))
    seen(scheduler, "realtime", [200 + 6 * i for i in range(64)])  # chat histories of 200-578 tokens
    seen(scheduler, "normal", [1000] * 64)  # and documents
    engine = SimEngine(
        PROFILES["h100-llama3-8b"], kv_capacity_tokens=1_000_000, policy="priority", long_prefill_token_threshold=256
    )
    assert _engine_runs(scheduler, engine, now_ms=0) == []
    assert engine.long_prefill_token_threshold == 592  # the engine chunks at the realtime prompts' size
    # Lower-tier prefills in flight: a long document and a log.
    lower = [make("normal", prompt=3000, arrival_ms=0), make("background", prompt=4000, arrival_ms=1)]
    for request in lower:
        scheduler.add(request)
    assert _engine_runs(scheduler, engine, now_ms=10) == lower
    engine.step()
    chat = make("realtime", prompt=570, arrival_ms=20)
    scheduler.add(chat)
    assert _engine_runs(scheduler, engine, now_ms=20) == [chat]  # admitted at once, beside both
    step = engine.step()
    assert step.scheduled_tokens[chat.id] == 570  # its whole prompt in this step
    assert chat.id in step.new_token_ids  # and its first token


def test_the_lower_tiers_room_follows_their_arrivals_and_backlog_never_into_the_reserve() -> None:
    def room_after(prompt: int, every_ms: int, *, backlog: int = 0) -> tuple[int, int]:
        scheduler = TailcutPolicy(SchedulerConfig(background_gate_max_waiting=0))
        scheduler.prefill_chunk_applied(512)
        chat_running(scheduler)
        for now_ms in range(0, 20_000, every_ms):  # 20 s of documents, each prefilled at once
            document = make("normal", prompt=prompt, arrival_ms=now_ms)
            scheduler.add(document)
            scheduler.schedule(roomy(step_ms=20), now_ms=now_ms)
            scheduler.prefilled(document.id)
            scheduler.finish(document.id)
        for index in range(backlog):
            scheduler.add(make("background", prompt=4000, arrival_ms=20_000 + index))
        room = scheduler.room(roomy(step_ms=20), now_ms=20_000)
        return room.lower_prefill, room.ceiling - room.decodes - room.reserve

    # 5 tokens/ms need 150 a step: the most of the budget floor's room (768) and a normal chunk
    # beside a background one (512 + 512).
    assert room_after(500, 100)[0] == 1024
    # 25 tokens/ms at 20 ms a step, with a half to spare, and a chunk: more than the floor gives.
    assert room_after(500, 20)[0] == pytest.approx(20 * 25 * 1.5 + 512, rel=0.03)
    slow, fast = room_after(500, 100, backlog=20)[0], room_after(500, 100, backlog=60)[0]
    assert 1024 < slow < fast  # a backlog to drain over 20 s raises it too
    assert room_after(500, 10, backlog=400) == (2048 - 1 - 256, 2048 - 1 - 256)  # up to the reserve, not into it


def test_the_backlog_counts_at_most_backlog_max_requests_of_a_tier() -> None:
    def lower_prefill(in_streams: int, most: int = 64) -> int:
        scheduler = TailcutPolicy(SchedulerConfig(backlog_max_requests=most))
        scheduler.prefill_chunk_applied(512)
        chat_running(scheduler)
        scheduler.add(make("background", prompt=4000))  # and ``in_streams`` more still in Redis
        view = roomy(step_ms=40, backlog={("background", "long"): in_streams})
        return scheduler.room(view, now_ms=0).lower_prefill

    assert 1024 < lower_prefill(47) < lower_prefill(63)  # the backlog to drain over 20 s raises the room
    # 64 in all: a longer queue waits for room instead of growing the steps the realtime replies decode through.
    assert lower_prefill(63) == lower_prefill(500)
    assert lower_prefill(500, most=128) > lower_prefill(63)


def test_background_leaves_the_normal_room_free_while_normal_requests_arrive() -> None:
    scheduler = TailcutPolicy(SchedulerConfig(prompt_window=64))
    scheduler.prefill_chunk_applied(512)  # the driver applies the chunk it asks for
    seen(scheduler, "normal", [500] * 64)
    backgrounds = [make("background", prompt=4000, arrival_ms=i) for i in range(8)]
    for request in backgrounds:
        scheduler.add(request)
    first = scheduler.schedule(roomy(), now_ms=0).admit
    assert first and all(request.tier == "background" for request in first)
    document = make("normal", prompt=500, arrival_ms=100)
    scheduler.add(document)
    # Background filled what it may; the document still fits beside it, at once.
    assert scheduler.schedule(roomy(), now_ms=100).admit == [document]


def test_background_prefill_waits_while_realtime_is_busier_than_usual() -> None:
    def background_admitted(num_realtime_now: int, *, waiting: int = 10, in_streams: int = 0) -> int:
        scheduler = TailcutPolicy(SchedulerConfig(background_gate_margin=0.1, background_gate_max_waiting=32))
        scheduler.prefill_chunk_applied(512)
        chats = [make("realtime", prompt=100, output=500) for _ in range(20)]
        for chat in chats:  # 20 chats in flight for 10 s: what is usual
            scheduler.add(chat)
        scheduler.schedule(roomy(), now_ms=0)
        for chat in chats:
            scheduler.prefilled(chat.id)
        for now_ms in range(0, 10_000, 20):
            scheduler.schedule(roomy(), now_ms=now_ms)
        for chat in chats[num_realtime_now:]:
            scheduler.finish(chat.id)
        for chat in [make("realtime", prompt=100, output=500) for _ in range(num_realtime_now - 20)]:
            scheduler.add(chat)
        scheduler.schedule(roomy(), now_ms=10_000)  # the realtime ones enter
        for index in range(waiting):
            scheduler.add(make("background", prompt=400, arrival_ms=10_000 + index))
        view = roomy(backlog={("background", "long"): in_streams})
        return sum(1 for request in scheduler.schedule(view, now_ms=10_020).admit if request.tier == "background")

    assert background_admitted(20) > 0  # as busy as usual
    assert background_admitted(22) == 0  # 10% more than usual: background waits
    assert background_admitted(22, waiting=32) > 0  # ... unless its queue reached the bound
    # A live worker holds only what it read ahead: the queue counts what waits in Redis too.
    assert background_admitted(22, waiting=10, in_streams=21) == 0
    assert background_admitted(22, waiting=10, in_streams=22) > 0


def test_until_the_driver_applies_the_chunk_the_configured_policy_holds() -> None:
    def admitted(follows: bool) -> list[Tier]:
        scheduler = TailcutPolicy(SchedulerConfig(prompt_window=64))
        seen(scheduler, "realtime", [500] * 64)
        seen(scheduler, "normal", [500] * 64)
        if follows:
            scheduler.prefill_chunk_applied(scheduler.prefill_chunk_tokens)
        for index in range(8):
            scheduler.add(make("background", prompt=4000, arrival_ms=index))
        return [request.tier for request in scheduler.schedule(roomy(), now_ms=100).admit]

    # The configured sizes (256-token chunks, a 256 reserve, no normal room): three background chunks
    # fill the 768 the budget floor leaves; chunks of 512 with a normal chunk's room kept: one.
    assert admitted(follows=False) == ["background"] * 3
    assert admitted(follows=True) == ["background"]


def test_while_the_steps_run_slow_the_lower_tiers_get_a_few_chunks_and_background_waits() -> None:
    def sizes(margin: float, steps_ms: list[float], *, max_waiting: int = 1_000, apart_ms: int = 14) -> Room:
        """The room after 30 s of 14-ms steps, then ``steps_ms`` one round each, ``apart_ms`` apart."""
        config = SchedulerConfig(
            slow_step_margin=margin, background_gate_max_waiting=max_waiting, backlog_max_requests=200
        )
        scheduler = TailcutPolicy(config)
        scheduler.prefill_chunk_applied(512)
        chat_running(scheduler, step_ms=14.0)
        for index in range(200):  # 200 background requests wait, as many realtime ones run as usual
            scheduler.add(make("background", prompt=4000, arrival_ms=index))
        now_ms = 0
        for index, step_ms in enumerate([14.0] * 2_000 + steps_ms):
            room = scheduler.room(roomy(step_ms=step_ms), now_ms=now_ms)
            now_ms += 14 if index < 2_000 else apart_ms
        return room

    usual = sizes(0.05, [])
    assert not usual.background_held and usual.lower_prefill > 2 * 512
    # 40 steps of 17 ms (a reply's life, 21% slower than usual): two chunks, and background waits.
    slow = sizes(0.05, [17.0] * 40)
    assert slow.background_held and slow.lower_prefill == 2 * 512
    assert not sizes(0.05, [17.0] * 3).background_held  # a few slow steps are not a stretch
    # A live worker runs rounds on arrivals and ticks too: 40 rounds over 3 steps' time are not a stretch.
    assert not sizes(0.05, [17.0] * 40, apart_ms=1).background_held
    assert not sizes(0.25, [17.0] * 40).background_held  # within the margin
    assert not sizes(0.0, [17.0] * 40).background_held  # 0: off
    # As many background requests wait as the gate's bound: background goes, in the two chunks.
    bounded = sizes(0.05, [17.0] * 40, max_waiting=200)
    assert not bounded.background_held and bounded.lower_prefill == 2 * 512
    # Back to usual steps for a while: the room is back.
    back = sizes(0.05, [17.0] * 40 + [14.0] * 200)
    assert not back.background_held and back.lower_prefill > 2 * 512


def test_at_the_step_ceiling_realtime_prefill_takes_the_reserve_before_the_lower_tiers_room() -> None:
    scheduler = TailcutPolicy(SchedulerConfig(background_gate_max_waiting=0, backlog_max_requests=400))
    scheduler.prefill_chunk_applied(512)
    chat_running(scheduler)
    for index in range(400):  # a backlog of logs: the lower tiers ask more than the ceiling leaves
        scheduler.add(make("background", prompt=4000, arrival_ms=index))
    assert [request.tier for request in scheduler.schedule(roomy(step_ms=20), now_ms=1000).admit] == [
        "background"
    ] * 3  # three chunks of 512 in a room of 2048 - 256 (the reserve) - 4 decodes
    chat = make("realtime", prompt=200, arrival_ms=1010)
    scheduler.add(chat)
    assert scheduler.schedule(roomy(step_ms=20), now_ms=1010).admit == [chat]
    room = scheduler.room(roomy(step_ms=20), now_ms=1020)
    assert room.at_ceiling and room.lower_limit == 2048 - 256
    # The chat's 200 tokens in flight are what the reserve is for: a 240-token document still fits
    # (5 decodes + 1536 + 240 of 1792), where counting them in the room too would leave it waiting.
    document = make("normal", prompt=240, arrival_ms=1020)
    scheduler.add(document)
    assert scheduler.schedule(roomy(step_ms=20), now_ms=1020).admit == [document]


def test_below_the_ceiling_realtime_prefill_counts_in_the_lower_tiers_room() -> None:
    room = Room(ceiling=2048, chunk=512, reserve=256, decodes=10, lower_prefill=1024, normal_room=0)
    spent = Spent(10, {"realtime": 200, "normal": 512, "background": 0})
    assert room.lower_spent(spent) == 722  # the reserve stays headroom for realtime prompts to come
    assert replace(room, at_ceiling=True).lower_spent(spent) == 522
    assert replace(room, at_ceiling=True).lower_spent(replace(spent, chunks={**spent.chunks, "realtime": 600})) == 866


def test_with_no_realtime_traffic_the_lower_tiers_fill_the_step() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    scheduler.prefill_chunk_applied(512)
    for index in range(255):  # a fresh worker does not know yet whether chats will come
        scheduler.add(make("background", prompt=4000, arrival_ms=index))
    assert scheduler.room(roomy(step_ms=20), now_ms=0).reserve == 256
    for index in range(255, 400):  # 400 logs, and no chat has come
        scheduler.add(make("background", prompt=4000, arrival_ms=index))
    room = scheduler.room(roomy(step_ms=20), now_ms=0)
    assert (room.reserve, room.lower_limit, room.background_held) == (0, 2048, False)
    assert [request.tier for request in scheduler.schedule(roomy(step_ms=20), now_ms=0).admit] == ["background"] * 4
    # A chat waiting in its intake stream, not yet read: it is coming.
    assert scheduler.room(roomy(step_ms=20, backlog={("realtime", "short"): 1}), now_ms=0).reserve == 256
    # A chat comes: the reserve is kept for realtime again, while it runs and after it.
    chat = make("realtime", prompt=100, arrival_ms=10)
    scheduler.add(chat)
    assert scheduler.schedule(roomy(step_ms=20), now_ms=10).admit == [chat]
    scheduler.prefilled(chat.id)
    scheduler.finish(chat.id)
    for index in range(255):
        scheduler.add(make("background", prompt=4000, arrival_ms=20 + index))
    room = scheduler.room(roomy(step_ms=20), now_ms=300)
    assert room.reserve == 256 and room.lower_limit <= 2048 - 256
    # 256 arrivals without a chat among them: the realtime tier stopped sending.
    scheduler.add(make("background", prompt=4000, arrival_ms=400))
    assert scheduler.room(roomy(step_ms=20), now_ms=400).reserve == 0


def test_a_normal_prompt_may_take_the_room_of_background_prompts_in_prefill() -> None:
    def arrives_behind_logs(takes: bool) -> tuple[list[SchedRequest], list[SchedRequest], list[SchedRequest]]:
        scheduler = TailcutPolicy(SchedulerConfig(normal_takes_background_prefill=takes))
        scheduler.prefill_chunk_applied(512)
        chat_running(scheduler)
        logs = [make("background", prompt=4000, arrival_ms=index) for index in range(8)]
        for log in logs:
            scheduler.add(log)
        taken = [request for request in scheduler.schedule(roomy(step_ms=20), now_ms=0).admit if request in logs]
        document = make("normal", prompt=500, arrival_ms=100)
        scheduler.add(document)
        decision = scheduler.schedule(roomy(step_ms=20), now_ms=100)
        return taken, decision.admit, decision.preempt

    taken, admitted, preempted = arrives_behind_logs(takes=False)
    assert taken  # a log's prompt fills the room: the document waits out its chunks
    assert admitted == [] and preempted == []
    taken, admitted, preempted = arrives_behind_logs(takes=True)
    assert [request.tier for request in admitted] == ["normal"]
    assert preempted == [taken[-1]]  # the newest log gives its room up, and only it


def test_a_realtime_prompt_the_step_would_split_may_take_the_room_of_background_prompts_in_prefill() -> None:
    def third_chat_arrives(takes: bool) -> tuple[list[SchedRequest], list[SchedRequest], int | None]:
        scheduler = TailcutPolicy(SchedulerConfig(realtime_takes_background_prefill=takes))
        scheduler.prefill_chunk_applied(512)
        chat_running(scheduler)
        for index in range(8):
            scheduler.add(make("background", prompt=4000, arrival_ms=index))
        log = scheduler.schedule(roomy(step_ms=20), now_ms=0).admit
        for _ in range(2):  # two chats' prompts, prefilled alongside the log's chunk
            scheduler.add(make("realtime", prompt=512, arrival_ms=10))
        assert [request.tier for request in scheduler.schedule(roomy(step_ms=20), now_ms=10).admit] == ["realtime"] * 2
        # A third: the engine runs the prompts in prefill first (5 decodes, 3 chunks: 1,541 tokens), and
        # what they leave of the 2,048-token step is less than its 512.
        scheduler.add(make("realtime", prompt=512, arrival_ms=20))
        decision = scheduler.schedule(roomy(step_ms=20), now_ms=20)
        assert [request.tier for request in decision.admit] == ["realtime"]
        return log, decision.preempt, decision.token_budget

    log, preempted, _ = third_chat_arrives(takes=False)
    assert [request.tier for request in log] == ["background"] and preempted == []
    log, preempted, budget = third_chat_arrives(takes=True)
    assert preempted == log  # the log gives its room up: the chat's prompt is prefilled whole
    assert budget is not None and budget < 2048


def test_past_what_the_worker_serves_the_room_is_the_budget_rules_in_the_configured_chunk() -> None:
    scheduler = TailcutPolicy(SchedulerConfig(overload_background_waiting=100, backlog_max_requests=200))
    seen(scheduler, "normal", [500] * 64)  # documents keep coming: background leaves them a chunk's room
    scheduler.prefill_chunk_applied(scheduler.prefill_chunk_tokens)
    chat_running(scheduler, step_ms=14.0)

    def room_with(num_waiting: int, now_ms: int) -> Room:
        while len(scheduler._background) < num_waiting:
            scheduler.add(make("background", prompt=4000, arrival_ms=now_ms))
        while len(scheduler._background) > num_waiting:
            scheduler.remove(next(iter(scheduler._background)).id)
        room = scheduler.room(roomy(step_ms=14.0), now_ms=now_ms)
        scheduler.prefill_chunk_applied(scheduler.prefill_chunk_tokens)  # the driver applies the chunk asked
        return room

    # 99 logs wait: the adaptive room (the demand term makes it more than the budget rule's 1,025 less
    # the chat's decode and the 256 reserve), a chunk of 512, a normal chunk's room kept.
    usual = room_with(99, 1_000)
    assert usual.lower_prefill > 768 and usual.normal_room == 512 and usual.chunk == 512
    # 100 wait: the budget rule's room, no normal room; the engine is asked for the configured chunk
    # (the chat's 50-token prompts need no more), which the next round counts with.
    over = room_with(100, 1_014)
    assert (over.lower_prefill, over.normal_room, over.background_held) == (768, 0, False)
    assert scheduler.prefill_chunk_tokens == 256 and room_with(100, 1_021).chunk == 256
    assert room_with(51, 1_028).lower_prefill == 768  # until half as many wait
    back = room_with(50, 1_042)
    assert back.lower_prefill > 768 and back.normal_room > 0 and scheduler.prefill_chunk_tokens == 512
    # Off (0, the default): never.
    off = TailcutPolicy(SchedulerConfig())
    assert not off.overloaded(10_000)
