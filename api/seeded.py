"""Seeded answers: the answer cache primed with a Q&A file's own answers (optional, off by default).

With ``TAILCUT_CACHE_SEED_FILE`` (the Q&A file prefix warmup reads, ``warmup.prefixes``), each API
process loads the ``TAILCUT_CACHE_SEED_TOP_N`` most asked questions at start and answers a request with
the file's answer, without the engine, when the request is exactly that chat — the question as the only
user message, after the line's system prompt if it has one (the same token ids the API builds) — and is
plain greedy: temperature 0, no stop strings or stop tokens, no penalties, no ``min_tokens`` or
``ignore_eos``, no ``Idempotency-Key``. A ``max_tokens`` below the answer's length cuts it after the
last whole word that fits (``finish_reason: "length"``).

The answer is the operator's, not the model's, and the reply says so: ``"tailcut": {"cache": "seeded"}``
on its final chunk (or the whole body). Seeded answers are the same for every tenant (they come from the
operator's file, not from any tenant's traffic). The answer's text is streamed a word at a time; its
token ids are the served tokenizer's tokens of each word, so ``usage.completion_tokens`` counts them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter

from queues.keys import TIERS
from queues.messages import RequestMessage, SamplingOptions
from tailcut.logs import log_event
from tailcut.models import encode_chat
from warmup.prefixes import conversation, load_qa, most_asked

log = logging.getLogger("tailcut.api")

WORD = re.compile(r"\s*\S+\s*$|\s*\S+")
PLAIN = SamplingOptions(temperature=0.0)


@dataclass(frozen=True, slots=True)
class SeededAnswer:
    chunks: list[tuple[str, list[int]]]  # a word's text and its token ids

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for _text, ids in self.chunks)


def words_of(tokenizer: Any, text: str) -> list[tuple[str, list[int]]]:
    return [(word, list(tokenizer.encode(word, add_special_tokens=False))) for word in WORD.findall(text)]


def plain_greedy(message: RequestMessage) -> bool:
    """Greedy with nothing else that changes the output (what a seeded answer stands for)."""
    sampling = message.sampling
    return (
        sampling.temperature == 0
        and not sampling.stop
        and not sampling.stop_token_ids
        and not sampling.ignore_eos
        and sampling.min_tokens == 0
        and sampling.presence_penalty == PLAIN.presence_penalty
        and sampling.frequency_penalty == PLAIN.frequency_penalty
        and sampling.repetition_penalty == PLAIN.repetition_penalty
        and not message.idempotency_key
    )


class SeededAnswers:
    def __init__(self, answers: dict[tuple[int, ...], SeededAnswer], registry: CollectorRegistry) -> None:
        self._answers = answers
        self.served = Counter(
            "tailcut_seeded_answers_total",
            "Requests answered with a seeded answer (the Q&A file's, not the model's).",
            ["tier"],
            registry=registry,
        )
        for tier in TIERS:
            self.served.labels(tier)

    @classmethod
    def load(cls, path: Path, tokenizer: Any, *, top_n: int, registry: CollectorRegistry) -> SeededAnswers:
        """The most asked questions of the file that have an answer; a bad file is a ``ConfigError``."""
        answers: dict[tuple[int, ...], SeededAnswer] = {}
        for entry in most_asked([entry for entry in load_qa(path) if entry.answer.strip()], top_n):
            prompt = tuple(encode_chat(tokenizer, conversation(entry)))
            answers.setdefault(prompt, SeededAnswer(words_of(tokenizer, entry.answer)))
        log_event(log, "seeded_answers_loaded", file=str(path), answers=len(answers))
        return cls(answers, registry)

    def __len__(self) -> int:
        return len(self._answers)

    def reply_for(self, message: RequestMessage) -> bytes | None:
        """The stored-reply form (``api.answers.cached_batches``) of the request's seeded answer, if any."""
        if not plain_greedy(message):
            return None
        answer = self._answers.get(tuple(message.prompt_token_ids))
        if answer is None:
            return None
        chunks, finish_reason = _cut(answer.chunks, message.sampling.max_tokens)
        self.served.labels(message.tier).inc()
        reply = {
            "chunks": chunks,
            "finish_reason": finish_reason,
            "prompt_tokens": len(message.prompt_token_ids),
            "completion_tokens": sum(len(ids) for _text, ids in chunks),
        }
        return orjson.dumps(reply)


def _cut(chunks: Sequence[tuple[str, list[int]]], max_tokens: int) -> tuple[list[tuple[str, list[int]]], str]:
    """The chunks within ``max_tokens``: whole words, then ``length`` at the first word that does not fit."""
    kept: list[tuple[str, list[int]]] = []
    count = 0
    for text, ids in chunks:
        if count + len(ids) > max_tokens:
            return kept, "length"
        kept.append((text, ids))
        count += len(ids)
    return kept, "stop"
