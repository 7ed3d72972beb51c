"""The answer cache at the API: exact repeats of deterministic requests answered without the engine.

A request is **eligible** when its output is a function of its input: greedy (temperature 0) or with a
fixed ``seed``, and not resumable (an ``Idempotency-Key`` request has its own replay). Its key is the
digest of the tenant, the model identity (name, and a fingerprint of its folder: config, tokenizer and
weight files' names, sizes and times, so a model replaced under the same name makes old entries stale),
the prompt's token ids and every sampling parameter. So no tenant ever reads another's answer.

On a **hit** the stored reply is streamed like a generated one — the same chunks, the same final and
usage — with ``"tailcut": {"cache": "hit"}`` on the final chunk (or the whole body), and the request
never reaches Redis's intake or a worker (its id is not resumable). On an **admitted miss** (the K-th
reference, ``queues.answers``) the reply is recorded as it streams and stored once it ends complete;
a degraded, failed or cancelled reply is never stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter
from redis.exceptions import RedisError

from queues.answers import AnswerStore, Reference
from queues.keys import TIERS
from queues.messages import OutputEvent, RequestMessage
from tailcut.logs import log_event

log = logging.getLogger("tailcut.api")

# Files whose change means another model (weights, config, tokenizer).
MODEL_FILES = ("*.json", "*.safetensors", "*.bin", "*.gguf", "*.model", "*.txt")


def model_identity(name: str, folder: Path) -> str:
    """``name@fingerprint``: the served name and a digest of the model folder's files (name, size, mtime)."""
    digest = hashlib.sha256()
    for pattern in MODEL_FILES:
        for path in sorted(folder.glob(pattern)):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return f"{name}@{digest.hexdigest()[:16]}"


def eligible(message: RequestMessage) -> bool:
    return (message.sampling.temperature == 0 or message.sampling.seed is not None) and not message.idempotency_key


def digest_of(message: RequestMessage, model_id: str) -> str:
    sampling = dataclasses.asdict(message.sampling)
    raw = orjson.dumps([message.tenant, model_id, message.prompt_token_ids, sampling], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(raw).hexdigest()


class AnswerCache:
    """The API's side: look a request up, serve a hit, record and store an admitted miss."""

    def __init__(self, store: AnswerStore, model_id: str, registry: CollectorRegistry) -> None:
        self._store = store
        self.model_id = model_id
        self.lookups = Counter(
            "tailcut_answer_cache_lookups_total",
            "Eligible requests looked up in the answer cache, by what they found: hit, miss, admit (a miss "
            "whose reply will be stored: its K-th reference), stale (an entry of another model, deleted).",
            ["tier", "result"],
            registry=registry,
        )
        self.stored = Counter(
            "tailcut_answer_cache_stored_total", "Replies stored in the answer cache.", registry=registry
        )
        self.evicted = Counter(
            "tailcut_answer_cache_evictions_total",
            "Entries evicted to keep the cache within its size.",
            registry=registry,
        )
        for tier in TIERS:
            for result in ("hit", "miss", "admit", "stale"):
                self.lookups.labels(tier, result)

    async def lookup(self, message: RequestMessage) -> tuple[str, Reference] | None:
        """The request's key and what it found; None when it is not eligible or Redis does not answer
        (the request then simply runs)."""
        if not eligible(message):
            return None
        digest = digest_of(message, self.model_id)
        try:
            found = await self._store.reference(digest, self.model_id, now_ms=int(time.time() * 1000))
        except RedisError as exc:
            log_event(log, "answer_cache_unavailable", logging.WARNING, error=str(exc))
            return None
        self.lookups.labels(message.tier, found.result).inc()
        return digest, found

    def recorder(self, digest: str, score: int, spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> Recorder:
        async def keep(reply: bytes) -> None:
            try:
                evicted = await self._store.store(digest, self.model_id, reply, score=score)
            except RedisError as exc:
                log_event(log, "answer_cache_store_failed", logging.WARNING, error=str(exc))
                return
            self.stored.inc()
            self.evicted.inc(evicted)

        return Recorder(lambda reply: spawn(keep(reply)))


class Recorder:
    """Collects a reply's chunks as they are delivered; hands the whole reply on when it ended complete."""

    def __init__(self, done: Callable[[bytes], None]) -> None:
        self._done = done
        self._chunks: list[tuple[str, list[int]]] = []
        self._degraded = False

    def on_batch(self, batch: list[OutputEvent]) -> None:
        for event in batch:
            if event.type == "chunk":
                self._chunks.append((event.text, event.token_ids))
            elif event.type == "degraded" or event.degraded:
                self._degraded = True
            elif event.type == "final" and not self._degraded and event.finish_reason is not None:
                reply = {
                    "chunks": self._chunks,
                    "finish_reason": event.finish_reason,
                    "prompt_tokens": event.prompt_tokens,
                    "completion_tokens": event.completion_tokens,
                }
                self._done(orjson.dumps(reply))


async def cached_batches(request_id: str, reply: bytes) -> AsyncIterator[list[OutputEvent]]:
    """A stored reply as one batch of output events, as a worker would have written them."""
    stored: dict[str, Any] = orjson.loads(reply)
    events = [
        OutputEvent(rid=request_id, seq=seq, type="chunk", text=text, token_ids=token_ids)
        for seq, (text, token_ids) in enumerate(stored["chunks"], start=1)
    ]
    events.append(
        OutputEvent(
            rid=request_id,
            seq=len(events) + 1,
            type="final",
            finish_reason=stored["finish_reason"],
            prompt_tokens=stored["prompt_tokens"],
            completion_tokens=stored["completion_tokens"],
        )
    )
    yield events
