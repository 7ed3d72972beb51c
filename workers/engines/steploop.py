"""Plumbing shared by the model-free engines (``null``, ``sim``): one background task computes every
request's tokens step by step and hands each request's output to its ``generate`` iterator.

This is how a real engine behaves towards its caller: one step yields the tokens of all running
requests at once, so a pipeline that coalesces per step sees realistic bursts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from queues.messages import SamplingSpec
from tailcut.errors import EngineDeadError, InvalidRequestError
from workers.engines.base import EngineDelta

log = logging.getLogger("tailcut.engine")


class DeltaCollector:
    """One request's output not yet taken by its consumer. Deltas merge while they wait, as vLLM's
    ``RequestOutputCollector`` does: the engine loop never waits for a consumer, and a slow consumer
    gets fewer, larger deltas. An error set with ``fail`` is raised after the output put before it."""

    def __init__(self) -> None:
        self._pending: EngineDelta | None = None
        self._error: BaseException | None = None
        # The consumer's wake-up while it waits: a bare future, not an asyncio.Event (whose wait and set
        # cost several times as much, once per running request per engine step).
        self._waiter: asyncio.Future[None] | None = None

    def put(self, delta: EngineDelta) -> None:
        pending = self._pending
        if pending is None:
            self._pending = delta
        else:
            pending.token_ids += delta.token_ids
            pending.text += delta.text
            pending.finish_reason = delta.finish_reason
            pending.num_cached_tokens = max(pending.num_cached_tokens, delta.num_cached_tokens)
        self._wake()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> EngineDelta:
        while True:
            if self._pending is not None:
                delta, self._pending = self._pending, None
                return delta
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class StepLoop:
    """The engine's one background task (``body``, started by the first request) and the collectors
    of the requests it serves. A crash of ``body`` kills the engine: every open request and every
    later one gets ``EngineDeadError``, so the worker stops instead of hanging."""

    def __init__(self, name: str, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._body = body
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._dead_reason: str | None = None
        self._collectors: dict[str, DeltaCollector] = {}

    def open(self, request_id: str) -> DeltaCollector:
        """Register a request and wake the loop; the caller then adds it to the engine's own state
        (before its next ``await``, so the loop sees both at once)."""
        if self._dead_reason is not None:
            raise EngineDeadError(f"{self.name} is dead: {self._dead_reason}")
        if request_id in self._collectors:
            raise InvalidRequestError(f"request id {request_id!r} is already running in the engine")
        if self._task is None:
            self._task = asyncio.create_task(self._guarded(), name=self.name)
        collector = DeltaCollector()
        self._collectors[request_id] = collector
        self._wake.set()
        return collector

    def close(self, request_id: str) -> None:
        self._collectors.pop(request_id, None)

    def deliver(self, request_id: str, delta: EngineDelta) -> None:
        """Hand a delta to the request's consumer (dropped if it is gone: aborted meanwhile)."""
        collector = self._collectors.get(request_id)
        if collector is None:
            return
        collector.put(delta)
        if delta.finished:
            del self._collectors[request_id]

    async def idle(self) -> None:
        """Wait until the next ``open``. Call it right after finding no work, with no ``await`` in
        between, so no request slips through."""
        self._wake.clear()
        await self._wake.wait()

    async def stop(self, reason: str = "the engine was shut down") -> None:
        self._dead_reason = self._dead_reason or reason
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._fail_all()

    async def _guarded(self) -> None:
        try:
            await self._body()
            reason = "its loop ended"
        except Exception as exc:
            log.exception("engine_loop_failed loop=%s", self.name)
            reason = f"its loop failed: {type(exc).__name__}: {exc}"
        self._dead_reason = self._dead_reason or reason
        self._fail_all()

    def _fail_all(self) -> None:
        for collector in self._collectors.values():
            collector.fail(EngineDeadError(f"{self.name} is dead: {self._dead_reason}"))
        self._collectors.clear()


def check_request(prompt_token_ids: list[int], sampling: SamplingSpec, max_model_len: int) -> None:
    """The checks vLLM makes before it accepts a request, with its kind of message."""
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty")
    if sampling.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {sampling.max_tokens}")
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({sampling.min_tokens}) must not exceed max_tokens ({sampling.max_tokens})"
        )
    if len(prompt_token_ids) + sampling.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"the prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({sampling.max_tokens}) exceeds "
            f"max_model_len ({max_model_len})"
        )
