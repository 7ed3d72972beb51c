"""Prefix warmup: a starting worker runs the most asked questions of a Q&A file through its engine with
one output token each, so vLLM's prefix cache holds their prompts before the customers ask them.

The file is JSON Lines, one question per line::

    {"question": "Where is my order?", "answer": "...", "hits": 1234, "system": "You are ..."}

``question`` is required; ``answer`` is the desk's answer (not used here: warmup fills the prefix cache,
it does not answer); ``hits`` (default 0) ranks the questions, most asked first, file order breaking
ties; ``system`` is the system prompt the service sends with that question, if any. A bad line is a
``ConfigError`` naming the file and line.

Each prompt is the chat the API would build for a customer asking that question
(``tailcut.models.encode_chat``: the same template, token for token), so a warmed question that arrives
finds all of its full KV blocks cached. First of all comes the chat template's own prefix — what every
conversation with the same system prompt starts with.

What is warmed is bounded: the ``top_n`` most asked questions, and no more than ``kv_share`` of the
engine's KV cache (counting each prompt's tokens past the shared prefix), since warming more than the
cache holds only evicts what was warmed first. Lines past the bound are skipped, and the worker says how
many.

``PrefixWarmer`` runs them without delaying anything: the worker serves from the start (readiness is
never held back for warmup), and the warmer submits a few prompts at a time (``concurrency``) at the
engine's lowest priority, only while the worker has no request of its own running or waiting. When one
arrives, the prompts in flight are aborted and put back, and warmup goes on at the next idle moment.

The prompts fill one tenant's prefix cache (``cache_salt``): vLLM salts each named tenant's apart unless
the operator lets tenants share it, so the warmer runs under the salt of the tenant it warms for.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from queues.messages import SamplingSpec
from tailcut.errors import ConfigError, InvalidRequestError
from tailcut.logs import log_event
from tailcut.models import encode_chat

log = logging.getLogger("tailcut.warmup")

# vLLM runs a lower priority value first; the worker's tiers use 0-5.
WARMUP_PRIORITY = 1_000
# How often the warmer looks whether real traffic arrived (and whether the worker is idle again).
POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class QaEntry:
    question: str
    answer: str = ""
    hits: int = 0
    system: str | None = None


def load_qa(path: Path) -> list[QaEntry]:
    """Every line of a Q&A file, in file order; a clear ``ConfigError`` for a bad one."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the Q&A file {path}: {exc.strerror or exc}") from exc
    entries: list[QaEntry] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            item = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc})") from exc
        if not isinstance(item, dict) or not isinstance(item.get("question"), str) or not item["question"].strip():
            raise ConfigError(f'{where}: each line is an object with a non-empty "question" string')
        hits, system, answer = item.get("hits", 0), item.get("system"), item.get("answer", "")
        if not isinstance(hits, int) or isinstance(hits, bool) or hits < 0:
            raise ConfigError(f'{where}: "hits" is a count (an integer >= 0), not {hits!r}')
        if system is not None and not isinstance(system, str):
            raise ConfigError(f'{where}: "system" is the system prompt, a string')
        if not isinstance(answer, str):
            raise ConfigError(f'{where}: "answer" is a string')
        entries.append(QaEntry(item["question"], answer, hits, system))
    return entries


def most_asked(entries: Sequence[QaEntry], top_n: int) -> list[QaEntry]:
    """The ``top_n`` entries with the most hits; file order among equal counts."""
    ranked = sorted(range(len(entries)), key=lambda index: (-entries[index].hits, index))
    return [entries[index] for index in ranked[:top_n]]


def conversation(entry: QaEntry) -> list[dict[str, str]]:
    system = [{"role": "system", "content": entry.system}] if entry.system is not None else []
    return [*system, {"role": "user", "content": entry.question}]


def template_prefix(tokenizer: Any, system: str | None) -> list[int]:
    """The tokens every conversation with this system prompt starts with: the template's system part
    and the opening of the user's turn (the common start of two renderings that differ in the user's
    words only)."""
    one = encode_chat(tokenizer, conversation(QaEntry("a", system=system)))
    two = encode_chat(tokenizer, conversation(QaEntry("b", system=system)))
    shared = sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(one, two, strict=False)))
    return one[:shared]


@dataclass(frozen=True, slots=True)
class WarmupPlan:
    """The prompts to warm, in order, and what the bounds left out."""

    prompts: list[list[int]]
    questions: int  # questions among the prompts (the rest are template prefixes)
    skipped: int  # questions of the file not warmed: past top_n, past the KV share, or too long


def plan(
    entries: Sequence[QaEntry],
    tokenizer: Any,
    *,
    top_n: int,
    kv_tokens: int,
    max_prompt_tokens: int,
) -> WarmupPlan:
    """Prompt ids for the most asked questions, each template prefix before the first question that
    uses it, within ``kv_tokens`` of new (unshared) tokens and ``max_prompt_tokens`` per prompt."""
    prompts: list[list[int]] = []
    prefixes: dict[str | None, list[int]] = {}
    spent = questions = 0
    for entry in most_asked(entries, top_n):
        if entry.system not in prefixes:
            prefix = template_prefix(tokenizer, entry.system)
            prefixes[entry.system] = prefix
            if 0 < len(prefix) <= max_prompt_tokens and spent + len(prefix) <= kv_tokens:
                prompts.append(prefix)
                spent += len(prefix)
        ids = encode_chat(tokenizer, conversation(entry))
        new_tokens = len(ids) - len(prefixes[entry.system])
        if len(ids) > max_prompt_tokens or spent + new_tokens > kv_tokens:
            break
        prompts.append(ids)
        spent += new_tokens
        questions += 1
    return WarmupPlan(prompts, questions, len(entries) - questions)


class WarmEngine(Protocol):
    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        priority: int,
        cache_salt: str | None = None,
    ) -> AsyncIterator[Any]: ...


class PrefixWarmer:
    """Runs a plan's prompts through the engine in the worker's idle moments (see the module doc)."""

    def __init__(
        self,
        engine: WarmEngine,
        prompts: Sequence[list[int]],
        *,
        busy: Callable[[], bool],
        concurrency: int = 4,
        cache_salt: str | None = None,
    ) -> None:
        """``cache_salt``: the salt of the tenant whose requests should find the prompts cached."""
        if concurrency < 1:
            raise ValueError("the warmer runs at least one prompt at a time")
        self._engine = engine
        self._prompts = list(prompts)
        self._busy = busy
        self._concurrency = concurrency
        self._cache_salt = cache_salt
        self.total = len(self._prompts)
        self.done = 0
        self.failed = 0
        self.yielded = 0  # prompts aborted because real traffic arrived (run again later)
        self.paused = 0  # times the warmer waited for real traffic to finish before its next prompts
        self.elapsed_s: float | None = None  # set when every prompt was run
        self._tasks: dict[asyncio.Task[None], tuple[int, list[int]]] = {}

    @property
    def in_flight(self) -> int:
        """Warmup prompts in the engine now."""
        return len(self._tasks)

    @property
    def finished(self) -> bool:
        return self.done + self.failed >= self.total

    async def run(self) -> None:
        started = time.monotonic()
        pending = deque(enumerate(self._prompts))
        log_event(log, "prefix_warmup_started", prompts=self.total, concurrency=self._concurrency)
        tasks = self._tasks
        try:
            while pending:
                await self._until_idle()
                batch = [pending.popleft() for _ in range(min(self._concurrency, len(pending)))]
                tasks.update({asyncio.create_task(self._one(index, ids)): (index, ids) for index, ids in batch})
                while tasks:
                    finished, _ = await asyncio.wait(tasks, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                    for task in finished:
                        del tasks[task]
                        if (error := task.exception()) is not None:
                            raise error  # the engine failed: stop warming
                    if tasks and self._busy():
                        # Real traffic: the engine is theirs. What was in flight runs again later.
                        await _cancel(tasks)
                        pending.extendleft(reversed(list(tasks.values())))
                        self.yielded += len(tasks)
                        tasks.clear()
        finally:
            await _cancel(tasks)  # stopped (or failed) midway: abort what is in the engine
            tasks.clear()
        self.elapsed_s = time.monotonic() - started
        log_event(
            log,
            "prefix_warmup_done",
            prompts=self.done,
            failed=self.failed,
            yielded=self.yielded,
            paused=self.paused,
            elapsed_ms=int(self.elapsed_s * 1000),
        )

    async def _until_idle(self) -> None:
        # busy() reads the worker's queues, which change on many events: polled, cheaply.
        if self._busy():
            self.paused += 1
        while self._busy():  # noqa: ASYNC110
            await asyncio.sleep(POLL_S)

    async def _one(self, index: int, prompt_ids: list[int]) -> None:
        request_id = f"warmup-{index}-{time.monotonic_ns()}"
        one_token = SamplingSpec(temperature=0.0, max_tokens=1)
        deltas = self._engine.generate(
            request_id, prompt_ids, one_token, priority=WARMUP_PRIORITY, cache_salt=self._cache_salt
        )
        try:
            async with contextlib.aclosing(deltas):  # type: ignore[type-var]
                async for _delta in deltas:
                    pass
        except InvalidRequestError as exc:
            self.failed += 1
            log_event(log, "prefix_warmup_prompt_refused", logging.WARNING, index=index, error=exc.message)
            return
        self.done += 1


async def _cancel(tasks: dict[asyncio.Task[None], Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
