"""The per-request state machine the worker and the simulator share (pure): calls, events, outcomes."""

from __future__ import annotations

from admission.admitter import Admitter
from admission.config import AdmissionConfig
from admission.request import GenerationRequest, ServedModel, TokenPrompt
from queues.messages import OutputEvent, RequestMessage, SamplingOptions
from workers.lifecycle import Continue, Finished, RequestLifecycle, Yield, resumed
from workers.policies import make_scheduler
from workers.scheduler import TailcutPolicy
from workers.scheduling import EngineView, SchedRequest, SchedulerConfig, SchedulingPolicy

ROOMY = EngineView(free_slots=10, free_kv_tokens=1 << 20)
FULL = EngineView(free_slots=0, free_kv_tokens=0)


def message(tier: str = "background", *, max_tokens: int = 600, at_ms: int = 0) -> RequestMessage:
    admitter = Admitter(AdmissionConfig(), ServedModel("m", 4096))
    request = GenerationRequest(
        prompt=TokenPrompt(list(range(1, 21))),
        reply_to="api",
        tier=tier,
        max_tokens=max_tokens,
        sampling=SamplingOptions(temperature=0.0, ignore_eos=True),
    )
    return admitter.admit_tokens(request, request_id="r", at_ms=at_ms)


def admitted(scheduler: SchedulingPolicy, msg: RequestMessage) -> RequestLifecycle:
    scheduler.add(SchedRequest.of(msg))
    (request,) = scheduler.schedule(ROOMY, now_ms=msg.enqueued_at_ms).admit
    return RequestLifecycle(msg, request, scheduler)


def run_call(life: RequestLifecycle, num_tokens: int, first_token: int = 100) -> list[OutputEvent]:
    events = [life.on_output([first_token + n], f"t{n}") for n in range(num_tokens)]
    return [event for event in events if event is not None]


def test_a_request_runs_in_slices_with_one_sequence_of_positions_and_one_final() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    life = admitted(scheduler, message(max_tokens=600))
    calls = [life.next_call()]
    events: list[OutputEvent] = []
    while True:
        events += run_call(life, calls[-1].sampling.max_tokens)
        outcome = life.end_call("length", lambda: ROOMY)
        if isinstance(outcome, Finished):
            events.append(outcome.event)
            break
        assert isinstance(outcome, Continue)
        calls.append(outcome.call)
    assert [call.sampling.max_tokens for call in calls] == [256, 256, 88]
    # Every slice resumes from the prompt plus everything generated so far.
    assert [len(call.prompt_token_ids) for call in calls] == [20, 276, 532]
    assert [event.seq for event in events] == list(range(1, 602))
    assert [event.type for event in events].count("final") == 1 and events[-1].completion_tokens == 600
    assert len({call.engine_request_id for call in calls}) == 3


def test_engine_ids_are_never_reused_across_yields_preemptions_and_take_overs() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    life = admitted(scheduler, message(max_tokens=2000))
    seen = [life.next_call().engine_request_id]
    run_call(life, 256)
    seen.append(life.end_call("length", lambda: ROOMY).call.engine_request_id)  # type: ignore[union-attr]
    run_call(life, 256)
    # Higher-tier work waits and there is no room: yield.
    scheduler.add(SchedRequest.of(message("realtime", max_tokens=10, at_ms=1)))
    outcome = life.end_call("length", lambda: FULL)
    assert isinstance(outcome, Yield)
    again = admitted(TailcutPolicy(SchedulerConfig()), outcome.message)
    seen.append(again.next_call().engine_request_id)
    run_call(again, 5)
    preempted = again.continuation()  # preempted mid-slice
    third = admitted(TailcutPolicy(SchedulerConfig()), preempted)
    seen.append(third.next_call().engine_request_id)
    taken_over = resumed(preempted, [OutputEvent(rid="r", seq=1, type="chunk", token_ids=[7])])
    fourth = admitted(TailcutPolicy(SchedulerConfig()), taken_over)
    seen.append(fourth.next_call().engine_request_id)
    assert len(set(seen)) == len(seen), seen
    assert outcome.message.generated_token_ids == life.generated and outcome.message.next_seq == 513
    assert preempted.next_seq == 518 and len(preempted.generated_token_ids) == 517


def test_a_request_that_started_never_expires() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    fresh = admitted(scheduler, message("realtime", max_tokens=50))
    deadline = fresh.message.deadline_ms
    assert not fresh.expired(deadline) and fresh.expired(deadline + 1)
    fresh.next_call()
    run_call(fresh, 3)
    continuation = fresh.continuation()
    resumed_life = admitted(TailcutPolicy(SchedulerConfig()), continuation)
    assert not resumed_life.expired(deadline + 60_000)


def test_an_end_of_sequence_finishes_before_max_tokens_and_baselines_do_not_slice() -> None:
    life = admitted(TailcutPolicy(SchedulerConfig()), message(max_tokens=600))
    life.next_call()
    run_call(life, 40)
    outcome = life.end_call("stop", lambda: ROOMY)
    assert isinstance(outcome, Finished) and outcome.event.finish_reason == "stop"
    fifo = admitted(make_scheduler(SchedulerConfig(policy="fifo")), message(max_tokens=600))
    call = fifo.next_call()
    assert (call.sampling.max_tokens, call.priority) == (600, 0)


def test_min_tokens_count_from_the_original_request() -> None:
    msg = message(max_tokens=600)
    msg.sampling.min_tokens = 300
    life = admitted(TailcutPolicy(SchedulerConfig()), msg)
    first = life.next_call()
    run_call(life, 256)
    second = life.end_call("length", lambda: ROOMY)
    assert isinstance(second, Continue)
    assert (first.sampling.min_tokens, second.call.sampling.min_tokens) == (256, 44)


def test_output_joins_the_unsent_chunk_at_its_position_and_positions_stay_gap_free() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    life = admitted(scheduler, message(max_tokens=8))
    life.next_call()
    first = life.on_output([100], "a")
    assert first is not None and first.seq == 1
    # The writer is behind: the next two deltas join the chunk still waiting to be written.
    assert life.on_output([101], "b", unsent=first) is None
    assert life.on_output([102, 103], "cd", unsent=first) is None
    assert (first.seq, first.text, first.token_ids) == (1, "abcd", [100, 101, 102, 103])
    # Written meanwhile (no unsent chunk): the next output takes the next position.
    second = life.on_output([104], "e")
    assert second is not None and second.seq == 2
    # Only the request's own newest chunk can be joined: an older or another request's one cannot.
    assert life.on_output([105], "f", unsent=first) is not None
    assert life.generated == [100, 101, 102, 103, 104, 105]
    outcome = life.end_call("stop", lambda: ROOMY)
    assert isinstance(outcome, Finished) and outcome.event.seq == 4 and outcome.event.completion_tokens == 6
    # A take-over resumes from what the (coalesced) stored events hold.
    again = resumed(life.message, [first, second])
    assert again.generated_token_ids == [100, 101, 102, 103, 104] and again.next_seq == 3


def stopping(stop: list[str], *, max_tokens: int = 40, min_tokens: int = 0) -> RequestLifecycle:
    admitter = Admitter(AdmissionConfig(), ServedModel("m", 4096))
    request = GenerationRequest(
        prompt=TokenPrompt(list(range(1, 21))),
        reply_to="api",
        tier="normal",
        max_tokens=max_tokens,
        sampling=SamplingOptions(temperature=0.0, stop=stop, min_tokens=min_tokens),
    )
    return admitted(TailcutPolicy(SchedulerConfig(slice_tokens=4)), admitter.admit_tokens(request, request_id="r"))


def feed(life: RequestLifecycle, pieces: list[str]) -> tuple[str, str | None, list[RequestLifecycle]]:
    """Run ``life`` over one token per piece of text, in calls of its slice, handing each call's end to
    the next (and every second call to a fresh lifecycle, as a continuation or a take-over would): the
    text sent, the reply's finish reason (None: the pieces ran out) and every lifecycle used."""
    sent, lives, index = "", [life], 0
    call = life.next_call()
    assert call.sampling.stop == []  # the engine is not asked to find them: it cannot across calls
    while index < len(pieces):
        limit = call.sampling.max_tokens
        for step in range(limit):
            last = step == limit - 1 or index == len(pieces) - 1
            reason = ("length" if step == limit - 1 else "stop") if last else None
            event = life.on_output([index], pieces[index], finish_reason=reason)
            index += 1
            sent += event.text if event is not None else ""
            if life.stopped_here:
                return sent, "stop", lives
            if last:
                break
        outcome = life.end_call("length" if index < len(pieces) else "stop", lambda: ROOMY)
        if isinstance(outcome, Finished):
            return sent, outcome.event.finish_reason, lives
        assert isinstance(outcome, Continue)
        if len(lives) % 2:
            taken_over = resumed(life.continuation(), [OutputEvent(rid="r", seq=1, type="chunk", held=life.held_text)])
            taken_over.generated_token_ids = list(life.generated)
            life = admitted(TailcutPolicy(SchedulerConfig(slice_tokens=4)), taken_over)
            lives.append(life)
        call = life.next_call()
    return sent, None, lives


def test_a_stop_string_across_engine_calls_ends_the_reply_where_it_begins() -> None:
    # Calls of 4 tokens: "X" "Y" "Z" "EN" | "D!" ... — the stop string "END!" spans the boundary.
    pieces = ["a", "b", "c", "EN", "D!", "zz", "q", "r", "s", "t"]
    sent, reason, lives = feed(stopping(["END!"]), pieces)
    assert (sent, reason) == ("abc", "stop")
    assert len(lives) == 2  # found by the lifecycle that took the first call's held text over


def test_text_held_at_a_call_boundary_is_sent_once_no_stop_string_begins_there() -> None:
    pieces = ["a", "b", "c", "EN", "x", "y", "z", "w", "1", "2"]
    sent, reason, _ = feed(stopping(["END!"], max_tokens=10), pieces)
    assert (sent, reason) == ("abcENxyzw12", "stop")


def test_a_stop_string_counts_only_past_min_tokens_and_inside_a_call_too() -> None:
    sent, reason, _ = feed(stopping(["ab"], min_tokens=3), ["a", "b", "c", "a", "b", "c"])
    assert (sent, reason) == ("abc", "stop")


def test_text_held_for_a_stop_string_is_sent_before_a_summary_takes_over() -> None:
    life = stopping(["END!"])
    life.next_call()
    sent = [life.on_output([1], "abcEN"), life.on_output([2], "X", finish_reason="length")]
    # The last three characters could begin "END!" (the next call may complete it): held.
    assert "".join(event.text for event in sent if event is not None) == "abc"
    held = life.release_held()
    assert held is not None and held.text == "ENX" and held.seq == 3
    assert life.release_held() is None and life.degrade(reason="heartbeat", gap_ms=600).seq == 4
