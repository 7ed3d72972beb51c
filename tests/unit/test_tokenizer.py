"""Admission's tokenizer: where a prompt is tokenized (the tiny test model's real tokenizer)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from admission.tokenizer import INLINE_MAX_CHARS, MESSAGE_CHARS, PromptTokenizer


class Where:
    """Records the thread each call of a tokenizer's encode method ran on."""

    def __init__(self, tokenizer: PromptTokenizer, name: str) -> None:
        self.threads: list[str] = []
        encode = getattr(tokenizer, name)

        def recorded(*args: object) -> list[int]:
            self.threads.append(threading.current_thread().name)
            return encode(*args)  # type: ignore[no-any-return]

        setattr(tokenizer, name, recorded)


@pytest.fixture
def tokenizer(tiny_model: Path) -> Iterator[PromptTokenizer]:
    made = PromptTokenizer(tiny_model, num_threads=1)
    yield made
    made.close()


async def test_a_short_prompt_is_tokenized_on_the_loop_and_a_long_one_in_the_pool(tokenizer: PromptTokenizer) -> None:
    where = Where(tokenizer, "_encode_text")
    short, long = "a" * INLINE_MAX_CHARS, "a" * (INLINE_MAX_CHARS + 1)
    assert await tokenizer.encode_text(short) == tokenizer.tokenizer.encode(short)
    assert await tokenizer.encode_text(long) == tokenizer.tokenizer.encode(long)
    loop_thread = threading.current_thread().name
    assert where.threads[0] == loop_thread
    assert where.threads[1] != loop_thread and where.threads[1].startswith("tokenize")


async def test_a_chat_is_measured_by_all_its_messages_and_their_number(tokenizer: PromptTokenizer) -> None:
    where = Where(tokenizer, "_encode_chat")
    half = "b" * (INLINE_MAX_CHARS // 2 - MESSAGE_CHARS)
    fits = [{"role": "system", "content": half}, {"role": "user", "content": half}]
    over = [{"role": "system", "content": half}, {"role": "user", "content": half + "b"}]
    many = [{"role": "user", "content": ""}] * (INLINE_MAX_CHARS // MESSAGE_CHARS + 1)  # no text, many turns
    assert await tokenizer.encode_chat(fits) == await tokenizer.encode_chat(fits)
    await tokenizer.encode_chat(over)
    await tokenizer.encode_chat(many)
    loop_thread = threading.current_thread().name
    assert where.threads[:2] == [loop_thread, loop_thread]
    assert where.threads[2] != loop_thread and where.threads[3] != loop_thread
