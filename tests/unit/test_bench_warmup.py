"""``tailcut bench warmup``'s trace and report (pure; the run itself needs the real engine)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from bench.stats import summarize
from bench.warmup import SAMPLE, Side, first_asks, question_trace, report_of
from tailcut.models import encode_chat
from warmup.prefixes import conversation, load_qa


def test_the_trace_asks_the_files_questions_as_the_api_renders_them_most_asked_most_often(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    entries = load_qa(SAMPLE)
    trace, asked = question_trace(entries, tokenizer, 400, 4.0, output_tokens=8, seed=3)
    again, _ = question_trace(entries, tokenizer, 400, 4.0, output_tokens=8, seed=3)
    assert trace == again  # one seed, one trace
    assert all(
        arrival.prompt_ids == tuple(encode_chat(tokenizer, conversation(entries[index])))
        for arrival, index in zip(trace, asked, strict=True)
    )
    top = max(range(len(entries)), key=lambda index: entries[index].hits)
    assert asked.count(top) > 400 * 0.05  # the file's hit counts weigh the draw
    assert [arrival.at_s for arrival in trace] == sorted(arrival.at_s for arrival in trace)


def test_first_asks_and_the_ratios_are_warmed_over_cold() -> None:
    assert first_asks([5, 7, 5, 9, 7]) == {0, 1, 3}
    cold = Side(False, 0, 3, None, 0, summarize([100.0, 200.0, 300.0]), summarize([100.0, 300.0]))
    warm = Side(True, 0, 3, 12.0, 50, summarize([50.0, 100.0, 150.0]), summarize([50.0, 150.0]))
    report = report_of([cold, warm], [], [], {})
    (ratios,) = report["ratios_warmed_over_cold"]
    assert ratios["ttft_p50"] == 0.5 and ratios["first_asks_ttft_p99"] == 0.5
    assert report["median_ratio_over_rounds"]["ttft_p50"] == 0.5 and report["rounds"] == 1
