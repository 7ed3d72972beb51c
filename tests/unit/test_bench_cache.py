"""The cache benchmark's trace: exact repeats of the popular questions, the same prompt on the wire."""

from __future__ import annotations

from bench.cache import repeat_trace
from bench.client import completion_body


def test_the_trace_repeats_popular_questions_exactly_at_the_asked_share() -> None:
    trace = repeat_trace(2000, 5.0, repeat_share=0.3, popular=20, prompt_tokens=48, output_tokens=32, seed=1)
    assert trace == repeat_trace(2000, 5.0, repeat_share=0.3, popular=20, prompt_tokens=48, output_tokens=32, seed=1)
    repeats = [arrival for arrival in trace if arrival.prompt_of is not None]
    assert 0.25 < len(repeats) / len(trace) < 0.33
    assert all(arrival.prompt_of < 20 and arrival.index >= 20 for arrival in repeats)  # type: ignore[operator]
    # Zipf: the most popular question is repeated most.
    counts = [sum(arrival.prompt_of == question for arrival in repeats) for question in range(20)]
    assert counts[0] == max(counts) and counts[0] > 3 * counts[-1]
    offsets = [arrival.at_s for arrival in trace]
    assert offsets == sorted(offsets) and 300 < offsets[-1] < 500  # 2000 requests at 5 per second
    first = completion_body("m", trace[repeats[0].prompt_of], salt=7)  # type: ignore[index]
    again = completion_body("m", repeats[0], salt=7)
    assert first["prompt"] == again["prompt"] and first["temperature"] == 0
    distinct = [arrival for arrival in trace if arrival.prompt_of is None][:2]
    assert completion_body("m", distinct[0], salt=7)["prompt"] != completion_body("m", distinct[1], salt=7)["prompt"]
