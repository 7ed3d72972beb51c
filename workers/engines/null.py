"""``null``: an engine that runs no model and costs nothing, for measuring tailcut's own overhead.

Every request gets exactly ``max_tokens`` tokens (the filler token of the served model, see
``workers.engines.filler``), finish reason ``length``: nothing ever stops it early (no EOS, so
``ignore_eos`` and ``min_tokens`` hold trivially; stop strings and stop token ids are not evaluated).
Like a real engine it produces tokens in steps: one loop gives every running request one token per
iteration, one iteration every ``step_ms`` from the start of the last (0: it just yields to the event
loop in between), so 200 concurrent streams get 200 deltas per step, all at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from queues.messages import SamplingSpec
from workers.engines.base import EngineDelta, OutputSink
from workers.engines.filler import FillerToken
from workers.engines.steploop import StepLoop, check_request, generate_with

# It holds no KV at all; a capacity no request mix reaches keeps the scheduler's KV check out of the way.
NULL_KV_CAPACITY_TOKENS = 1 << 40


class NullEngine:
    """Zero-cost engine: ``max_tokens`` filler tokens per request, one per step (see the module docstring)."""

    def __init__(self, *, max_model_len: int, filler: FillerToken, step_ms: float = 0.0) -> None:
        if max_model_len < 2 or step_ms < 0:
            raise ValueError(f"max_model_len must be at least 2 and step_ms not negative: {max_model_len}, {step_ms}")
        self._max_model_len = max_model_len
        self._filler = filler
        self._step_s = step_ms / 1000
        self._remaining: dict[str, int] = {}  # running request → tokens still to produce
        self._token_budget: int | None = None
        self._loop = StepLoop("null-engine", self._run)
        self.num_steps = 0

    def __repr__(self) -> str:
        return f"NullEngine(step_ms={self._step_s * 1000:g}, running={len(self._remaining)}, steps={self.num_steps})"

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        return NULL_KV_CAPACITY_TOKENS

    @property
    def token_budget(self) -> int | None:
        """The last budget set; it has no effect (a step costs nothing whatever its size)."""
        return self._token_budget

    async def set_token_budget(self, num_tokens: int) -> int | None:
        self._token_budget = num_tokens
        return num_tokens

    async def set_prefill_chunk(self, num_tokens: int) -> int | None:
        """A prompt costs nothing here: there is no chunk to set."""
        return None

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        priority: int,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[EngineDelta, None]:
        return generate_with(self, request_id, prompt_token_ids, sampling, priority=priority, cache_salt=cache_salt)

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        priority: int,
        cache_salt: str | None,  # no effect here: this engine's prefix cache is not salted
        sink: OutputSink,
    ) -> None:
        check_request(prompt_token_ids, sampling, self._max_model_len)
        self._loop.open(request_id, sink)
        self._remaining[request_id] = sampling.max_tokens

    async def abort(self, request_id: str) -> None:
        """Stop the request; its sink gets finish reason ``abort``."""
        if self._remaining.pop(request_id, None) is not None:
            self._loop.deliver(request_id, EngineDelta(token_ids=[], text="", finish_reason="abort"))

    def num_unfinished(self) -> int:
        return len(self._remaining)

    async def shutdown(self) -> None:
        self._remaining.clear()
        await self._loop.stop()

    async def _run(self) -> None:
        token_id, text = self._filler.token_id, self._filler.text
        due = time.monotonic()
        while True:
            if not self._remaining:
                await self._loop.idle()
                due = time.monotonic()
                continue
            for request_id, left in list(self._remaining.items()):
                left -= 1
                if left:
                    self._remaining[request_id] = left
                else:
                    del self._remaining[request_id]
                self._loop.deliver(request_id, EngineDelta([token_id], text, None if left else "length"))
            self.num_steps += 1
            # Steps start every step_ms, however long handing out their tokens took (a GPU engine steps
            # on while its caller handles the last step's output); a caller slower than that holds the
            # next step back, as vLLM's output queue would.
            due = max(due + self._step_s, time.monotonic())
            await asyncio.sleep(due - time.monotonic())
