"""The engine plug-in point: what a worker needs from an inference engine, and nothing more."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from queues.messages import SamplingSpec


@dataclass(slots=True)
class EngineDelta:
    """New output of one request since the previous delta."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputSink(Protocol):
    """Where an engine hands one request's output, from the loop that processes each engine step:
    every request's delta of a step in turn, with no task woken per request. Both methods run inside
    that loop, so they must return at once and never raise."""

    def on_delta(self, delta: EngineDelta) -> None:
        """New output; the last one has ``finish_reason`` set (``abort`` after ``Engine.abort``)."""
        ...

    def on_error(self, error: BaseException) -> None:
        """The request ends without a last delta (``EngineDeadError``: the engine died)."""
        ...


class Engine(Protocol):
    """An inference engine with streaming generation and abort."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds in all."""
        ...

    async def set_token_budget(self, num_tokens: int) -> int | None:
        """Apply a per-step token budget; returns the value in force, ``None`` if unsupported."""
        ...

    async def set_prefill_chunk(self, num_tokens: int) -> int | None:
        """Apply the most prompt tokens one request computes per step (0: no cap); returns the value
        in force, ``None`` if unsupported."""
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        priority: int,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[EngineDelta, None]:
        """Stream deltas until the request finishes; cancelling the iteration aborts the request.
        ``cache_salt``: prompts with different salts never share prefix-cache blocks (vLLM's)."""
        ...

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        priority: int,
        cache_salt: str | None,
        sink: OutputSink,
    ) -> None:
        """Start a request whose output goes to ``sink`` (``generate``, without an iterator per request:
        the worker's path, once per token of every running request). The caller ends it early with
        ``abort``; refused requests raise here, as in ``generate``."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def num_unfinished(self) -> int:
        """Requests the engine holds right now (running or waiting inside the engine)."""
        ...

    async def shutdown(self) -> None: ...
