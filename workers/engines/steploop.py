"""Plumbing shared by the engines: ``StepLoop``, the model-free engines' (``null``, ``sim``) one background
task that computes every request's tokens step by step and hands each request's output to its sink
(``base.OutputSink``); ``DeltaCollector``, the sink behind every engine's ``generate`` iterator.

This is how a real engine behaves towards its caller: one step yields the tokens of all running
requests at once, so a pipeline that coalesces per step sees realistic bursts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from queues.messages import SamplingSpec
from tailcut.errors import EngineDeadError, InvalidRequestError
from workers.engines.base import Engine, EngineDelta, OutputSink

log = logging.getLogger("tailcut.engine")


class DeltaCollector:
    """One request's output not yet taken by its consumer (an ``OutputSink``). Deltas merge while they
    wait, as vLLM's ``RequestOutputCollector`` does: the engine loop never waits for a consumer, and a
    slow consumer gets fewer, larger deltas. An error is raised after the output put before it."""

    def __init__(self) -> None:
        self._pending: EngineDelta | None = None
        self._error: BaseException | None = None
        # The consumer's wake-up while it waits: a bare future, not an asyncio.Event (whose wait and set
        # cost several times as much, once per running request per engine step).
        self._waiter: asyncio.Future[None] | None = None

    def on_delta(self, delta: EngineDelta) -> None:
        pending = self._pending
        if pending is None:
            self._pending = delta
        else:
            pending.token_ids += delta.token_ids
            pending.text += delta.text
            pending.finish_reason = delta.finish_reason
            pending.num_cached_tokens = max(pending.num_cached_tokens, delta.num_cached_tokens)
        self._wake()

    def on_error(self, error: BaseException) -> None:
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


async def generate_with(
    engine: Engine,
    request_id: str,
    prompt_token_ids: list[int],
    sampling: SamplingSpec,
    *,
    priority: int,
    cache_salt: str | None,
) -> AsyncGenerator[EngineDelta, None]:
    """``Engine.generate`` from its ``submit``: the request's deltas as an iterator, aborted in the
    engine if the iteration ends before the last one."""
    collector = DeltaCollector()
    await engine.submit(
        request_id, prompt_token_ids, sampling, priority=priority, cache_salt=cache_salt, sink=collector
    )
    finished = False
    try:
        while not finished:
            delta = await collector.get()
            finished = delta.finished
            yield delta
    finally:
        if not finished:
            await engine.abort(request_id)


class StepLoop:
    """The engine's one background task (``body``, started by the first request) and the sinks of the
    requests it serves. A crash of ``body`` kills the engine: every open request and every
    later one gets ``EngineDeadError``, so the worker stops instead of hanging."""

    def __init__(self, name: str, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._body = body
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._dead_reason: str | None = None
        self._sinks: dict[str, OutputSink] = {}

    def open(self, request_id: str, sink: OutputSink) -> None:
        """Register a request and wake the loop; the caller then adds it to the engine's own state
        (before its next ``await``, so the loop sees both at once)."""
        if self._dead_reason is not None:
            raise EngineDeadError(f"{self.name} is dead: {self._dead_reason}")
        if request_id in self._sinks:
            raise InvalidRequestError(f"request id {request_id!r} is already running in the engine")
        if self._task is None:
            self._task = asyncio.create_task(self._guarded(), name=self.name)
        self._sinks[request_id] = sink
        self._wake.set()

    def close(self, request_id: str) -> None:
        """Forget a request without a word to its sink (the engine refused it after ``open``)."""
        self._sinks.pop(request_id, None)

    def deliver(self, request_id: str, delta: EngineDelta) -> None:
        """Hand a delta to the request's sink (dropped if it is gone: aborted meanwhile); the last one
        closes the request."""
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        if delta.finished:
            del self._sinks[request_id]
        sink.on_delta(delta)

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
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.on_error(EngineDeadError(f"{self.name} is dead: {self._dead_reason}"))


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
