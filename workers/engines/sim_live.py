"""``sim``: the SIMULATOR ``SimEngine`` run in real time inside the live pipeline (API, Redis, worker).

Not an inference engine: no model runs. One loop calls ``SimEngine.step()`` while the simulator holds
requests and lets each step take its modelled duration (``workers.engines.costmodel``) times
``time_scale`` in real time, against a monotonic schedule: a step starts when the previous one was
due, or later if the event loop was late — the time this process spends computing a step and
delivering tokens is absorbed by the wait, never added on top of it, and lateness stretches real
time instead of shortening later steps. At the end of a step, every request that sampled a token gets
it as one ``EngineDelta`` (all of the step's deltas at once, as from a real engine). When the
simulator is empty the loop waits; the next request first moves the virtual clock over the idle
time (``idle_until``), so virtual time stays real time divided by ``time_scale``.

``time_scale`` (default 4): every simulated microsecond takes that many real ones, so a modelled H100
step of 6–20 ms lasts 24–80 ms and two shared CPU cores keep up with the pipeline around it. Every
time clients measure is real time: divide it by ``time_scale`` to read it in simulated (GPU) time,
and multiply the time-based settings that should keep their GPU meaning (deadlines, slack margin,
SLO thresholds) by it. The loop logs ``sim_behind`` when it falls more than 5% behind its schedule:
raise ``time_scale`` then.

Every request runs to ``max_tokens`` (no EOS, stop strings and stop token ids are not evaluated)
and finishes with ``length``; ``abort`` or cancelling the ``generate`` iteration removes it from the
simulator. Prompts go into the simulator as their real token ids (so its prefix cache sees real
prefixes), and every generated token is the served model's filler token (``workers.engines.filler``),
which the simulator also records as the token it generated: a continuation's prompt (prompt +
generated so far) hits the blocks its earlier slice left in the prefix cache, as it would in vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from queues.messages import SamplingSpec
from tailcut.errors import InvalidRequestError
from tailcut.logs import log_event
from workers.engines.base import EngineDelta, OutputSink
from workers.engines.filler import FillerToken
from workers.engines.sim import SimEngine, StepResult
from workers.engines.steplog import StepLog
from workers.engines.steploop import StepLoop, check_request, generate_with

log = logging.getLogger("tailcut.engine")

DEFAULT_TIME_SCALE = 4.0
# Steps kept in ``RealtimeSimEngine.steps`` (for tests and reports).
DEFAULT_HISTORY_STEPS = 10_000
# How often the loop checks whether it keeps its schedule, and the lateness share it warns above.
BEHIND_CHECK_S = 10.0
BEHIND_WARN_SHARE = 0.05
# Consecutive steps that scheduled nothing while requests wait: the simulator is stuck (a bug).
MAX_IDLE_STEPS = 10_000


@dataclass(frozen=True, slots=True)
class TimedStep:
    """One simulated step as it ran in real time (``time.monotonic()`` seconds)."""

    result: StepResult
    start_s: float  # the previous step's due time, or later if the loop was late
    due_s: float  # start_s + duration_us x time_scale / 1e6: when its tokens were due
    delivered_s: float  # when they were handed to the requests' consumers

    @property
    def late_s(self) -> float:
        return self.delivered_s - self.due_s


class RealtimeSimEngine:
    """SIMULATOR: ``SimEngine`` stepped in real time behind the ``Engine`` protocol (see the module
    docstring). ``steps`` holds the most recent steps it ran."""

    def __init__(
        self,
        sim: SimEngine,
        *,
        max_model_len: int,
        filler: FillerToken,
        time_scale: float = DEFAULT_TIME_SCALE,
        history_steps: int = DEFAULT_HISTORY_STEPS,
        step_log: StepLog | None = None,
    ) -> None:
        if time_scale <= 0 or max_model_len < 2:
            raise ValueError(f"time_scale must be positive and max_model_len at least 2: {time_scale}, {max_model_len}")
        self._sim = sim
        self._max_model_len = max_model_len
        self._filler = filler
        self._time_scale = time_scale
        self._step_log = step_log
        # Requests in flight → prompt tokens served from the prefix cache at admission (None: not admitted yet).
        self._cached_tokens: dict[str, int | None] = {}
        # The real time the virtual clock's present (``sim.now_us``) maps to.
        self._due_s = time.monotonic()
        self._loop = StepLoop("sim-engine (SIMULATOR)", self._run)
        self.steps: deque[TimedStep] = deque(maxlen=history_steps)
        self.num_steps = 0
        # Real seconds the loop started steps later than scheduled (event-loop lag, Python overhead
        # beyond a step's duration); the virtual clock does not move meanwhile.
        self.behind_s = 0.0

    def __repr__(self) -> str:
        return f"RealtimeSimEngine(SIMULATOR, time_scale={self._time_scale:g}, sim={self._sim!r})"

    @property
    def sim(self) -> SimEngine:
        return self._sim

    @property
    def time_scale(self) -> float:
        return self._time_scale

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        return self._sim.kv_capacity_tokens

    async def set_token_budget(self, num_tokens: int) -> int | None:
        return self._sim.set_token_budget(num_tokens)

    async def set_prefill_chunk(self, num_tokens: int) -> int | None:
        return self._sim.set_prefill_chunk(num_tokens)

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
        if request_id in self._cached_tokens:
            raise InvalidRequestError(f"request id {request_id!r} is already running in the engine")
        if not self._sim.num_unfinished():
            self._skip_idle_time()
        try:
            self._sim.add(request_id, list(prompt_token_ids), sampling.max_tokens, priority=priority)
        except ValueError as exc:
            raise InvalidRequestError(f"the engine refused the request: {exc}") from exc
        self._cached_tokens[request_id] = None
        if self._step_log is not None:
            self._step_log.added(self._sim, request_id, len(prompt_token_ids), priority)
        try:
            self._loop.open(request_id, sink)
        except Exception:
            self._forget(request_id)
            raise

    async def abort(self, request_id: str) -> None:
        """Drop the request from the simulator; its sink gets finish reason ``abort``."""
        if self._sim.abort(request_id):
            self._cached_tokens.pop(request_id, None)
            self._loop.deliver(request_id, EngineDelta(token_ids=[], text="", finish_reason="abort"))

    def num_unfinished(self) -> int:
        return len(self._cached_tokens)

    async def shutdown(self) -> None:
        await self._loop.stop()
        for request_id in list(self._cached_tokens):
            self._forget(request_id)
        if self._step_log is not None:
            self._step_log.close()
        log_event(
            log,
            "sim_stopped",
            engine="SIMULATOR",
            steps=self.num_steps,
            virtual_s=round(self._sim.now_us / 1e6, 3),
            behind_ms=round(self.behind_s * 1000),
        )

    def _skip_idle_time(self) -> None:
        """Move the empty simulator's clock over the real time it sat idle, divided by the scale."""
        now = time.monotonic()
        if now > self._due_s:
            self._sim.idle_until(self._sim.now_us + (now - self._due_s) * 1e6 / self._time_scale)
            self._due_s = now

    def _forget(self, request_id: str) -> None:
        self._sim.abort(request_id)
        self._cached_tokens.pop(request_id, None)
        self._loop.close(request_id)

    async def _run(self) -> None:
        sim = self._sim
        real_s_per_us = self._time_scale / 1e6
        num_idle_steps = 0
        window_start, window_behind = time.monotonic(), self.behind_s
        while True:
            if not sim.num_unfinished():
                # The next request moves the clock over the idle time when it arrives (generate).
                await self._loop.idle()
                continue
            now = time.monotonic()
            if now > self._due_s:
                self.behind_s += now - self._due_s
            start = max(now, self._due_s)
            result = sim.step()
            due = self._due_s = start + result.duration_us * real_s_per_us
            if result.idle:
                num_idle_steps += 1
                if num_idle_steps > MAX_IDLE_STEPS:
                    raise RuntimeError(f"the simulator scheduled nothing in {MAX_IDLE_STEPS} steps: {sim!r}")
                await asyncio.sleep(0)
                continue
            num_idle_steps = 0
            if self._step_log is not None:
                self._step_log.stepped(sim, result)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            self._deliver(result)
            self.num_steps += 1
            self.steps.append(TimedStep(result, start, due, time.monotonic()))
            if due - window_start >= BEHIND_CHECK_S:
                share = (self.behind_s - window_behind) / (due - window_start)
                if share > BEHIND_WARN_SHARE:
                    log_event(
                        log,
                        "sim_behind",
                        logging.WARNING,
                        engine="SIMULATOR",
                        behind_share=round(share, 3),
                        time_scale=self._time_scale,
                        hint="raise TAILCUT_ENGINE__SIM_TIME_SCALE",
                    )
                window_start, window_behind = due, self.behind_s

    def _deliver(self, result: StepResult) -> None:
        for request_id, num_cached in result.num_cached_tokens.items():
            if request_id in self._cached_tokens and self._cached_tokens[request_id] is None:
                self._cached_tokens[request_id] = num_cached  # vLLM reports the first admission's hits
        finished = set(result.finished)
        token_id, text = self._filler.token_id, self._filler.text
        for request_id in result.new_token_ids:
            num_cached = self._cached_tokens.get(request_id) or 0
            if request_id in finished:
                self._cached_tokens.pop(request_id, None)  # no longer held here
                delta = EngineDelta([token_id], text, "length", num_cached_tokens=num_cached)
            else:
                delta = EngineDelta([token_id], text, None, num_cached_tokens=num_cached)
            self._loop.deliver(request_id, delta)
