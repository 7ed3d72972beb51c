"""Prefix warmup's plan (pure, with the tiny model's real tokenizer) and its warmer's manners: it warms
only while the worker is idle and gives the engine back at once when traffic arrives."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from admission.tokenizer import PromptTokenizer
from queues.messages import SamplingSpec
from tailcut.errors import ConfigError, InvalidRequestError
from warmup.prefixes import WARMUP_PRIORITY, PrefixWarmer, QaEntry, load_qa, most_asked, plan, template_prefix

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "warmup" / "qa" / "customer-service.jsonl"


def write(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_shipped_sample_is_what_its_script_writes(tmp_path: Path) -> None:
    out = tmp_path / "qa.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make-qa-sample"), "--out", str(out)], check=True)
    assert out.read_bytes() == SAMPLE.read_bytes()
    entries = load_qa(SAMPLE)
    assert len(entries) > 1000  # more than the default top-N, so the bound is exercised
    assert len({entry.question for entry in entries}) == len(entries)
    assert all(entry.answer and entry.hits >= 1 for entry in entries)


def test_a_bad_line_is_an_error_that_names_the_file_and_line(tmp_path: Path) -> None:
    good = '{"question": "Where is my order?", "answer": "Under Account.", "hits": 3}'
    cases = {
        "not json": "line 2: not JSON",
        '{"answer": "no question"}': 'non-empty "question"',
        '{"question": "  "}': 'non-empty "question"',
        '{"question": "q", "hits": -1}': '"hits" is a count',
        '{"question": "q", "hits": true}': '"hits" is a count',
        '{"question": "q", "system": 5}': '"system" is the system prompt',
    }
    for line, message in cases.items():
        path = write(tmp_path / "qa.jsonl", good, line)
        with pytest.raises(ConfigError, match=message) as raised:
            load_qa(path)
        assert f"{path}, line 2" in str(raised.value)
    with pytest.raises(ConfigError, match="cannot read the Q&A file"):
        load_qa(tmp_path / "missing.jsonl")


def test_most_asked_first_file_order_among_equals(tmp_path: Path) -> None:
    path = write(
        tmp_path / "qa.jsonl",
        '{"question": "a", "hits": 1}',
        '{"question": "b", "hits": 9}',
        "",
        '{"question": "c"}',
        '{"question": "d", "hits": 9}',
    )
    entries = load_qa(path)
    assert [entry.question for entry in most_asked(entries, 10)] == ["b", "d", "a", "c"]
    assert [entry.question for entry in most_asked(entries, 2)] == ["b", "d"]


async def test_warmed_prompts_are_the_apis_prompts_token_for_token(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    api = PromptTokenizer(tiny_model, num_threads=1)
    entries = [
        QaEntry("where is my order", hits=5),
        QaEntry("can I cancel", hits=4, system="you are the support desk"),
        QaEntry("how do refunds work", hits=3),
    ]
    warm = plan(entries, tokenizer, top_n=10, kv_tokens=1 << 30, max_prompt_tokens=4096)
    try:
        expected = []
        for entry in entries:
            system = [{"role": "system", "content": entry.system}] if entry.system else []
            expected.append(await api.encode_chat([*system, {"role": "user", "content": entry.question}]))
    finally:
        api.close()
    plain, support = template_prefix(tokenizer, None), template_prefix(tokenizer, "you are the support desk")
    # Each system prompt's template prefix comes before the first question that uses it.
    assert warm.prompts == [plain, expected[0], support, expected[1], expected[2]]
    assert warm.questions == 3 and warm.skipped == 0
    assert all(ids[: len(plain)] == plain for ids in (expected[0], expected[2]))
    assert expected[1][: len(support)] == support and plain != support


def test_the_plan_stops_at_top_n_and_at_its_share_of_the_kv_cache(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    entries = load_qa(SAMPLE)
    everything = plan(entries, tokenizer, top_n=1000, kv_tokens=1 << 30, max_prompt_tokens=1 << 20)
    assert everything.questions == 1000 and everything.skipped == len(entries) - 1000
    prefix = len(template_prefix(tokenizer, None))
    bounded = plan(entries, tokenizer, top_n=1000, kv_tokens=5000, max_prompt_tokens=1 << 20)
    new_tokens = prefix + sum(len(ids) - prefix for ids in bounded.prompts[1:])
    assert new_tokens <= 5000
    assert 0 < bounded.questions < 1000
    # The next question would not have fitted: the bound is used, not merely respected.
    following = everything.prompts[len(bounded.prompts)]
    assert new_tokens + len(following) - prefix > 5000
    assert bounded.prompts == everything.prompts[: len(bounded.prompts)]
    assert bounded.skipped == len(entries) - bounded.questions


class RecordingEngine:
    """An engine stand-in for the warmer's own logic: each prompt takes ``step_s`` to 'prefill'."""

    def __init__(self, step_s: float = 0.05) -> None:
        self.step_s = step_s
        self.started: list[tuple[float, list[int]]] = []
        self.completed: list[list[int]] = []
        self.in_flight = 0
        self.priorities: set[int] = set()
        self.max_tokens: set[int] = set()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        priority: int,
        cache_salt: str | None = None,
    ) -> AsyncIterator[Any]:
        self.started.append((asyncio.get_running_loop().time(), prompt_token_ids))
        self.priorities.add(priority)
        self.max_tokens.add(sampling.max_tokens)
        self.in_flight += 1
        try:
            if prompt_token_ids == [666]:
                raise InvalidRequestError("too long")
            await asyncio.sleep(self.step_s)
            self.completed.append(prompt_token_ids)
            yield object()
        finally:
            self.in_flight -= 1


async def test_the_warmer_runs_only_while_idle_and_gives_way_to_traffic_at_once() -> None:
    engine = RecordingEngine(step_s=0.2)
    prompts = [[index] for index in range(12)] + [[666]]
    busy = False
    warmer = PrefixWarmer(engine, prompts, busy=lambda: busy, concurrency=4)
    task = asyncio.create_task(warmer.run())
    await asyncio.sleep(0.05)
    assert engine.in_flight == 4  # a batch is in the engine
    busy = True  # a request arrived
    await asyncio.sleep(0.06)
    assert engine.in_flight == 0 and warmer.yielded == 4 and warmer.done == 0
    assert warmer.paused == 1  # and waits before its next prompts
    started_while_busy = len(engine.started)
    await asyncio.sleep(0.3)
    assert len(engine.started) == started_while_busy  # nothing new while the worker is busy
    busy = False
    await asyncio.wait_for(task, timeout=5)
    assert sorted(engine.completed) == [[index] for index in range(12)]  # the aborted ones ran again
    assert warmer.done == 12 and warmer.failed == 1 and warmer.finished
    assert engine.priorities == {WARMUP_PRIORITY} and engine.max_tokens == {1}
    assert warmer.elapsed_s is not None


async def test_a_stopped_warmer_leaves_nothing_in_the_engine() -> None:
    engine = RecordingEngine(step_s=10)
    warmer = PrefixWarmer(engine, [[1], [2]], busy=lambda: False, concurrency=2)
    task = asyncio.create_task(warmer.run())
    await asyncio.sleep(0.05)
    assert engine.in_flight == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.in_flight == 0
