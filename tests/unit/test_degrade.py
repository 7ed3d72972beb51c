"""The summary fallback's pure parts: when a request is late, what its lifecycle emits, how the
client is told."""

from __future__ import annotations

from api.render import ChatRenderer, CompletionRenderer
from queues.messages import OutputEvent
from tests.unit.test_lifecycle import ROOMY, admitted, message, run_call
from workers.degrade import DegradeConfig, summary_messages
from workers.lifecycle import Finished
from workers.scheduler import TailcutPolicy
from workers.scheduling import SchedulerConfig


def test_a_request_is_late_past_its_tiers_limit_and_only_when_a_summary_is_shorter() -> None:
    config = DegradeConfig()
    assert config.is_late("realtime", 501, remaining_tokens=500)
    assert not config.is_late("realtime", 499, remaining_tokens=500)
    assert not config.is_late("background", 60_000, remaining_tokens=500), "background never degrades"
    assert not config.is_late("normal", 5_000, remaining_tokens=config.summary_max_tokens), "finishing is as short"


def test_the_summary_prompt_quotes_the_ends_of_prompt_and_answer() -> None:
    system, user = summary_messages("x" * 50 + "the question?", "a" * 50 + "the answer so", quote_chars=20)
    assert system["role"] == "system" and user["role"] == "user"
    assert "the question?" in user["content"] and "the answer so" in user["content"]
    assert "x" * 40 not in user["content"]


def test_a_degraded_request_emits_the_notice_then_its_summary_then_one_final_that_says_so() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    life = admitted(scheduler, message("realtime", max_tokens=600))
    life.next_call()
    run_call(life, 40)
    notice = life.degrade(reason="heartbeat", gap_ms=812)
    call = life.summary_call([1, 2, 3], max_tokens=24)
    assert (
        notice.type == "degraded"
        and notice.seq == 41
        and notice.degraded
        == {
            "degraded": "summary",
            "reason": "heartbeat",
            "gap_ms": 812,
        }
    )
    assert call.prompt_token_ids == [1, 2, 3] and call.sampling.max_tokens == 24 and call.sampling.temperature == 0
    assert call.priority < scheduler.engine_priority(life.request), "ahead of its own tier"
    run_call(life, 10, first_token=900)
    outcome = life.end_call("length", lambda: ROOMY)
    assert isinstance(outcome, Finished), "a summary finishes the request, whatever its reason"
    assert outcome.event.seq == 52 and outcome.event.degraded == notice.degraded
    assert outcome.event.completion_tokens == 50


def test_the_client_sees_the_notice_and_the_final_chunk_and_body_marked() -> None:
    degraded: dict[str, str | int] = {"degraded": "summary", "reason": "heartbeat", "gap_ms": 600}
    final = OutputEvent(rid="r", seq=9, type="final", finish_reason="stop", completion_tokens=5, degraded=degraded)
    notice = OutputEvent(rid="r", seq=4, type="degraded", degraded=degraded)
    chat = ChatRenderer("r", "m", return_token_ids=False, include_usage=False)
    assert chat.notice(notice)["tailcut"] == degraded and chat.notice(notice)["choices"][0]["delta"] == {}
    assert chat.finish(final)["tailcut"] == degraded
    assert (
        CompletionRenderer("r", "m", return_token_ids=False, include_usage=False).whole("t", [], final)["tailcut"]
        == degraded
    )
    plain = OutputEvent(rid="r", seq=9, type="final", finish_reason="stop")
    assert "tailcut" not in chat.finish(plain) and "tailcut" not in chat.whole("t", [], plain)


def test_in_degrade_mode_a_long_realtime_reply_is_capped_and_says_so() -> None:
    scheduler = TailcutPolicy(SchedulerConfig())
    life = admitted(scheduler, message("realtime", max_tokens=600))
    notice = life.cap(16, reason="breaker")
    assert notice is not None and notice.seq == 1
    assert notice.degraded == {"degraded": "capped", "reason": "breaker", "max_tokens": 16}
    call = life.next_call()
    assert call.sampling.max_tokens == 16 and life.request.remaining_tokens == 16
    run_call(life, 16)
    outcome = life.end_call("length", lambda: ROOMY)
    assert isinstance(outcome, Finished) and outcome.event.completion_tokens == 16
    assert outcome.event.degraded == notice.degraded
    short = admitted(TailcutPolicy(SchedulerConfig()), message("realtime", max_tokens=10))
    assert short.cap(16, reason="breaker") is None and short.degraded is None, "short replies are left alone"
