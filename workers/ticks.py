"""Periodic work that runs in the wake-ups a busy worker has anyway, not in wake-ups of its own.

A worker that streams tokens wakes once per engine step, for the engine's output. A helper loop on its
own timer (the scheduling tick, the backlog probe, the degrade watchdog) wakes it again between those,
and on a host whose engine threads spin on every core each such wake-up takes a core from a step.
``Ticks.call_after(period_s, callback)`` runs ``callback`` at the first ``beat()`` at least ``period_s``
later (the worker beats as it takes each engine output), or, when no beat comes (nothing streams, or a
step outlasts the slack), by a timer of its own at ``period_s + slack_s``: never sooner than asked, at
most ``slack_s`` later, and while output flows in no wake-up of its own.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable

COMPACT_AT = 64


class Tick:
    """One pending ``Ticks.call_after``: runs its callback once (a beat or its own timer at ``late_s``,
    whichever is first) unless cancelled before."""

    __slots__ = ("_callback", "_timer")

    def __init__(self, callback: Callable[[], object], late_s: float) -> None:
        self._callback: Callable[[], object] | None = callback
        self._timer = asyncio.get_running_loop().call_later(late_s, self.fire)

    def fire(self) -> None:
        callback, self._callback = self._callback, None
        if callback is None:
            return
        self._timer.cancel()
        callback()

    def cancel(self) -> None:
        self._callback = None
        self._timer.cancel()

    @property
    def pending(self) -> bool:
        return self._callback is not None


class Ticks:
    """The pending ticks of one process (or one component), in order of their due time."""

    __slots__ = ("_compact_at", "_heap", "_order")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Tick]] = []
        self._order = itertools.count()  # ties in due time keep their order; ticks never compare
        # A cancelled tick stays in the heap until a beat passes its due time; without beats (nothing
        # streams) the heap is cleared of them once it holds this many.
        self._compact_at = COMPACT_AT

    def call_after(self, period_s: float, callback: Callable[[], object], *, slack_s: float | None = None) -> Tick:
        """``callback`` at the first beat ``period_s`` from now or later, or at ``period_s + slack_s``
        (default: ``period_s``, so at most twice the period) by its own timer."""
        tick = Tick(callback, period_s + (period_s if slack_s is None else slack_s))
        heap = self._heap
        if len(heap) >= self._compact_at:
            heap[:] = [entry for entry in heap if entry[2].pending]
            heapq.heapify(heap)
            self._compact_at = max(COMPACT_AT, 2 * len(heap))
        heapq.heappush(heap, (time.monotonic() + period_s, next(self._order), tick))
        return tick

    async def wait(self, period_s: float, *, slack_s: float | None = None) -> None:
        """Sleep as ``call_after`` would call back."""
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        tick = self.call_after(period_s, wake, slack_s=slack_s)
        try:
            await woken
        finally:
            tick.cancel()

    def beat(self, now: float | None = None) -> None:
        """The process is awake for other work (``now``: ``time.monotonic()``, when the caller has it): run
        every tick that is due. One comparison when none is."""
        heap = self._heap
        if now is None:
            now = time.monotonic()
        while heap and heap[0][0] <= now:
            heapq.heappop(heap)[2].fire()

    def release(self) -> None:
        """Run every pending tick now (the process is stopping: its loops look at their stop flag)."""
        heap, self._heap = self._heap, []
        for _due, _order, tick in heap:
            tick.fire()
