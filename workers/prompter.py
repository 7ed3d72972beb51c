"""The summarisation prompt in the served model's own tokens (``workers.degrade``).

The worker holds token ids only (the API tokenized the prompt once); to ask for a summary it decodes
the prompt and the text so far with the model's tokenizer and renders the summary request with the
model's chat template. Loading the tokenizer takes a moment, once, at worker start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tailcut.models import encode_chat
from workers.degrade import summary_messages


class Prompter:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer (prefix warmup renders its prompts with it too)."""
        return self._tokenizer

    @classmethod
    def load(cls, model_dir: Path) -> Prompter:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir))

    def summary_prompt(
        self, prompt_ids: list[int], generated_ids: list[int], *, max_prompt_tokens: int, quote_chars: int
    ) -> list[int]:
        """Token ids of the summary request, at most ``max_prompt_tokens`` (the quotes are shortened
        until it fits)."""
        prompt_text = self._tokenizer.decode(prompt_ids, skip_special_tokens=True)
        answer = self._tokenizer.decode(generated_ids, skip_special_tokens=True)
        while True:
            ids = self._render(summary_messages(prompt_text, answer, quote_chars=quote_chars))
            if len(ids) <= max_prompt_tokens or quote_chars <= 16:
                return ids[-max_prompt_tokens:]
            quote_chars //= 2

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self._tokenizer, "chat_template", None):
            return encode_chat(self._tokenizer, messages)
        plain = "\n\n".join(message["content"] for message in messages)
        return list(self._tokenizer.encode(plain, add_special_tokens=True))
