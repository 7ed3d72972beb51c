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

**The tiny-request pool** (DESIGN.md scheduling rule 10) is a second LRU-K pool of its own (its keys,
its size bound ``TAILCUT_CACHE_TINY_MAX_ENTRIES``, its ``tailcut_tiny_pool_*`` metrics) for the
replies to very short prompts, shared by every tenant. A request goes to it — and its key leaves the
tenant out — exactly when it is eligible (above), its prompt is under ``TINY_PROMPT_TOKENS`` (8) tokens
besides the chat template's own, and it carries no context of its tenant's: a completion prompt (the
whole prompt is those few tokens), or a chat whose only message is the user's — no system prompt, no
earlier turns. Anything else stays in the tenant's own cache. Such a reply is the same for whoever
asks (same model, same prompt, same parameters, deterministic), so sharing it reveals no tenant's data;
a hit says ``"pool": "tiny"`` beside ``"cache": "hit"``.
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


TINY_PROMPT_TOKENS = 8
# The tiny pool's stand-in for the tenant in its keys: one pool for all.
SHARED_TENANT = "*"


def eligible(message: RequestMessage) -> bool:
    return (message.sampling.temperature == 0 or message.sampling.seed is not None) and not message.idempotency_key


def is_tiny(message: RequestMessage, *, own_words_only: bool, template_tokens: int) -> bool:
    """Whether the request belongs in the shared tiny pool: ``own_words_only`` (a completion prompt, or a
    chat of one user message) and under ``TINY_PROMPT_TOKENS`` tokens besides ``template_tokens`` (the
    chat template's own; 0 for a completion)."""
    return own_words_only and len(message.prompt_token_ids) - template_tokens < TINY_PROMPT_TOKENS


def digest_of(message: RequestMessage, model_id: str, *, tenant: str | None = None) -> str:
    sampling = dataclasses.asdict(message.sampling)
    owner = message.tenant if tenant is None else tenant
    raw = orjson.dumps([owner, model_id, message.prompt_token_ids, sampling], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(raw).hexdigest()


class AnswerCache:
    """The API's side of one pool: look a request up, serve a hit, record and store an admitted miss.
    ``shared``: the tiny-request pool (keys without the tenant, metrics ``tailcut_tiny_pool_*``)."""

    def __init__(self, store: AnswerStore, model_id: str, registry: CollectorRegistry, *, shared: bool = False) -> None:
        self._store = store
        self.model_id = model_id
        self.shared = shared
        name, what = (
            ("tailcut_tiny_pool", "the tiny-request pool") if shared else ("tailcut_answer_cache", "the answer cache")
        )
        self.lookups = Counter(
            f"{name}_lookups_total",
            f"Eligible requests looked up in {what}, by what they found: hit, miss, admit (a miss "
            "whose reply will be stored: its K-th reference), stale (an entry of another model, deleted).",
            ["tier", "result"],
            registry=registry,
        )
        self.stored = Counter(f"{name}_stored_total", f"Replies stored in {what}.", registry=registry)
        self.evicted = Counter(
            f"{name}_evictions_total", f"Entries evicted to keep {what} within its size.", registry=registry
        )
        for tier in TIERS:
            for result in ("hit", "miss", "admit", "stale"):
                self.lookups.labels(tier, result)

    async def lookup(self, message: RequestMessage) -> tuple[str, Reference] | None:
        """The request's key and what it found; None when it is not eligible or Redis does not answer
        (the request then simply runs)."""
        if not eligible(message):
            return None
        digest = digest_of(message, self.model_id, tenant=SHARED_TENANT if self.shared else None)
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
