"""How ``tailcut chaos`` judges what it saw (pure): positions, duplicates, gaps, outcomes, references."""

from __future__ import annotations

import io

from rich.console import Console

from bench.chaos import ChaosConfig, ChaosResult, Fault, next_token_after
from bench.chaos_client import Spec, StreamTrace
from bench.chaos_report import HEADLINE, print_summary, summary

SPEC = Spec(0, "realtime", [1, 2, 3], 3)


def chunk(tokens: list[int], finish: str | None = None, **extra: object) -> dict[str, object]:
    return {"choices": [{"token_ids": tokens, "finish_reason": finish}], **extra}


def trace_of(*events: tuple[int | None, dict[str, object]], request_id: str = "r") -> StreamTrace:
    trace = StreamTrace(SPEC, request_id=request_id, accepted=True)
    for position, (event_id, payload) in enumerate(events):
        trace.see(event_id, payload, float(position))
    return trace


def test_a_stream_is_judged_by_its_positions() -> None:
    whole = trace_of((1, chunk([7])), (2, chunk([8])), (3, chunk([9])), (4, chunk([], "length")))
    again = trace_of((1, chunk([7])), (1, chunk([7])), (3, chunk([9])), (4, chunk([], "length")))
    assert (whole.terminal, whole.duplicates, whole.missing(), whole.token_ids()) == ("final", 0, 0, [7, 8, 9])
    assert (again.duplicates, again.missing()) == (1, 1)
    # The API joins a stream's pending chunks into one frame at the last one's position: no gap.
    joined = trace_of((2, chunk([7, 8])), (3, chunk([9])), (4, chunk([], "length")))
    assert (joined.duplicates, joined.missing(), joined.token_ids()) == (0, 0, [7, 8, 9])
    late = trace_of((1, chunk([7])), (3, chunk([8, 9])), (2, chunk([8])), (4, chunk([], "length")))
    assert (late.duplicates, late.missing(), late.token_ids()) == (1, 0, [7, 8, 9])


def test_outcomes_and_the_comparison_with_the_reference() -> None:
    traces = [
        trace_of((1, chunk([7])), (2, chunk([8])), (3, chunk([9])), (4, chunk([], "length"))),
        trace_of((1, chunk([7])), (2, chunk([6])), (3, chunk([9])), (4, chunk([], "length"))),
        trace_of((1, chunk([7])), (2, chunk([], "stop", tailcut={"degraded": "summary"}))),
        trace_of((1, chunk([7])), (None, {"error": {"code": "expired", "message": "late"}})),
        trace_of((1, chunk([7]))),
        StreamTrace(SPEC, rejected_status=429),
    ]
    result = ChaosResult(ChaosConfig(), 1.0, traces, {0: [7, 8, 9]}, [], [("x", 400, True)])
    counts = summary(result)
    assert [counts[key] for key in HEADLINE] == [5, 2, 1, 1, 1, 0, 0, 1]
    assert counts["refused_before_acceptance"] == 1 and counts["failures"] == ["expired: late"]


def test_the_wait_after_a_kill_is_that_of_the_streams_in_flight_per_tier() -> None:
    traces = [trace_of((1, chunk([1])), (2, chunk([2])), (3, chunk([3])), (4, chunk([4])))]  # times 0..3
    assert next_token_after(Fault("kill_worker", 0.0, 1.5), traces) == {"realtime": 0.5}
    assert next_token_after(Fault("kill_worker", 0.0, 9.0), traces) == {}
    # A background stream that waits behind the other tiers after the kill is reported as its own tier's.
    background = StreamTrace(Spec(1, "background", [4], 3), request_id="b", accepted=True)
    for position, at in ((1, 1.0), (2, 6.0), (3, 7.0)):
        background.see(position, chunk([position]), at)
    kill = Fault("kill_worker", 0.0, 1.5)
    kill.next_token_by_tier = next_token_after(kill, [*traces, background])
    assert kill.next_token_by_tier == {"realtime": 0.5, "background": 4.5}
    counts = summary(ChaosResult(ChaosConfig(), 1.0, [*traces, background], {}, [kill], []))
    assert counts["kill_to_next_token_s"] == {
        "max": 4.5,
        "each": [4.5],
        "by_tier": {"realtime": 0.5, "background": 4.5},
    }
    out = io.StringIO()
    print_summary(Console(file=out, width=200), counts)
    assert "4.50 s (realtime 0.50 s, background 4.50 s)" in out.getvalue()
    assert counts["faults"][0]["next_token_s"] == 4.5 and counts["faults"][0]["next_token_by_tier"]["background"] == 4.5
