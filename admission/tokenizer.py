"""Tokenizing prompts once, at admission, with the served model's own tokenizer.

Tokenizing a long prompt takes milliseconds of CPU; it runs in a bounded thread pool so the event
loop keeps serving other clients' streams meanwhile. A short one (a chat turn) is tokenized on the
loop: it takes less than the hand-off to a pool thread and back would add to its first token.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tailcut.models import encode_chat

# Prompts of at most this many characters are tokenized on the event loop. Measured on 2 shared cores
# with the tiny test model's tokenizer (its worst case: about one token per 1.4 characters): 512
# characters take about 260 µs there, a pool thread's hand-off and wake-up about 190 µs on top of the
# work itself.
INLINE_MAX_CHARS = 512
# What one chat message counts beside its content: the template renders each (16 two-letter messages
# take about 200 µs, 256 of them 2 ms).
MESSAGE_CHARS = 32


class PromptTokenizer:
    def __init__(self, model_dir: Path, *, num_threads: int) -> None:
        from transformers import AutoTokenizer

        self._tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="tokenize")
        self.vocab_size: int = len(self._tokenizer)
        self.eos_token_id: int | None = self._tokenizer.eos_token_id
        # The chat template's own tokens around one user turn: a chat prompt's length minus this is
        # what the user wrote (the tiny-request pool counts that).
        self.template_tokens: int = (
            len(self._encode_chat([{"role": "user", "content": ""}])) if self.has_chat_template else 0
        )

    @property
    def tokenizer(self) -> Any:
        """The served model's Hugging Face tokenizer (for work at start, off the request path)."""
        return self._tokenizer

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The threads that tokenize (watched for a growing queue)."""
        return self._pool

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return encode_chat(self._tokenizer, messages)

    def _encode_text(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if sum(len(message["content"]) + MESSAGE_CHARS for message in messages) <= INLINE_MAX_CHARS:
            return self._encode_chat(messages)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._encode_chat, messages)

    async def encode_text(self, text: str) -> list[int]:
        if len(text) <= INLINE_MAX_CHARS:
            return self._encode_text(text)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._encode_text, text)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
