"""How late this process's event loop runs, how far its thread pools are behind, and every stack.

- **Loop lag**: a timer set for ``interval_s`` fires late by exactly the time the loop spent on
  something else (a blocking call, a long pure-Python stretch). ``LoopWatch`` measures that lateness
  each interval: ``tailcut_event_loop_lag_seconds`` (histogram) and a warning — a log line and, where
  the process has one, an event on ``tc:events`` — when one interval was later than ``warn_after_s``
  (at most one warning per ``WARN_EVERY_S``, with the count in between).
- **Thread pools**: ``tailcut_thread_pool_queued_tasks{pool}``, the work items waiting for a thread of
  each pool registered (the API's tokenizer pool): a queue that grows says the pool is too small or
  its work too slow (an exhausted pool).
- **Stacks**: ``dump_stacks()`` is every asyncio task's and every thread's stack as text — what one
  would get with ``gdb`` and ``thread apply all bt``, in Python terms — for the API's admin-only
  ``GET /debug/stacks``; ``log_stacks`` writes it into the log (a worker's or jobs process's SIGUSR1).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tailcut.logs import log_event

log = logging.getLogger("tailcut.loop")

LAG_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
WARN_EVERY_S = 60.0
# ``LoopWatch.stop`` cancels the watch again this often until it has ended.
STOP_RETRY_S = 0.5

WarningSink = Callable[[dict[str, object]], Awaitable[None]]


class LoopWatch:
    """Measures the running loop's lag every ``interval_s`` and each registered pool's queue."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        process: str,
        interval_s: float = 0.25,
        warn_after_s: float = 0.1,
        on_warning: WarningSink | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.warn_after_s = warn_after_s
        self._process = process
        self._on_warning = on_warning
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._last_warning = -WARN_EVERY_S
        self._late_since_warning = 0
        self.lag = Histogram(
            "tailcut_event_loop_lag_seconds",
            "How late a timer of this process's event loop fired (time the loop was busy elsewhere).",
            ["process"],
            buckets=LAG_BUCKETS_S,
            registry=registry,
        )
        self.worst = Gauge(
            "tailcut_event_loop_lag_max_seconds",
            "The largest lag of the last minute.",
            ["process"],
            registry=registry,
        )
        self.warnings = Counter(
            "tailcut_event_loop_lag_warnings_total",
            "Intervals whose lag passed the warning threshold.",
            ["process"],
            registry=registry,
        )
        self.queued = Gauge(
            "tailcut_thread_pool_queued_tasks",
            "Work items waiting for a thread of the pool.",
            ["process", "pool"],
            registry=registry,
        )
        # Every family has its samples from the start (a scrape right after start finds them at 0).
        self.lag.labels(process)
        self.worst.labels(process).set(0)
        self.warnings.labels(process)
        self._window: list[tuple[float, float]] = []

    def watch_pool(self, name: str, pool: ThreadPoolExecutor) -> None:
        self._pools[name] = pool
        self.queued.labels(self._process, name).set(0)

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name="loop-watch")

    async def stop(self) -> None:
        """End the watch. A warning's report may be in flight on a client that swallows the cancellation
        (redis-py's asyncio connections can), so the loop also ends on ``_stopping``, and the task is
        cancelled again until it is done: a shutdown must not wait on it for ever."""
        self._stopping = True
        task, self._task = self._task, None
        if task is None:
            return
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=STOP_RETRY_S)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            await self.observe(max(0.0, loop.time() - due))

    async def observe(self, lag_s: float, *, now: float | None = None) -> None:
        """Record one interval's lag (the loop calls it; tests call it with chosen values)."""
        now = time.monotonic() if now is None else now
        process = self._process
        self.lag.labels(process).observe(lag_s)
        self._window = [(at, lag) for at, lag in self._window if now - at < WARN_EVERY_S] + [(now, lag_s)]
        self.worst.labels(process).set(max(lag for _at, lag in self._window))
        for name, pool in self._pools.items():
            self.queued.labels(process, name).set(pool_queue(pool))
        if lag_s <= self.warn_after_s:
            return
        self.warnings.labels(process).inc()
        self._late_since_warning += 1
        if now - self._last_warning < WARN_EVERY_S:
            return
        fields: dict[str, object] = {
            "type": "event_loop_lag",
            "process": process,
            "lag_ms": int(lag_s * 1000),
            "late_intervals": self._late_since_warning,
        }
        self._last_warning, self._late_since_warning = now, 0
        log_event(log, "event_loop_lag", logging.WARNING, **{k: v for k, v in fields.items() if k != "type"})
        if self._on_warning is not None:
            try:
                await self._on_warning(fields)
            except Exception as exc:  # a warning must never take the process down
                log_event(log, "event_loop_lag_report_failed", logging.WARNING, error=str(exc))


def pool_queue(pool: ThreadPoolExecutor) -> int:
    """Work items submitted to ``pool`` and not yet picked up by one of its threads."""
    return pool._work_queue.qsize()


def dump_stacks() -> str:
    """Every asyncio task of the running loop (if any) and every thread, with their stacks."""
    out = io.StringIO()
    with contextlib.suppress(RuntimeError):  # no running loop: threads only
        tasks = sorted(asyncio.all_tasks(), key=lambda task: task.get_name())
        out.write(f"--- {len(tasks)} asyncio tasks ---\n")
        for task in tasks:
            out.write(f"\n{task.get_name()} ({task.get_coro()!r})\n")
            task.print_stack(limit=20, file=out)
    frames = sys._current_frames()
    threads = {thread.ident: thread for thread in threading.enumerate()}
    out.write(f"\n--- {len(frames)} threads ---\n")
    for ident, frame in frames.items():
        thread = threads.get(ident)
        name = thread.name if thread is not None else "unknown"
        out.write(f"\nthread {name} ({ident})\n")
        out.write("".join(traceback.format_stack(frame)))
    return out.getvalue()


def log_stacks(logger: logging.Logger, event: str = "stacks", level: int = logging.INFO, **fields: object) -> None:
    """``dump_stacks()`` into the process's log as one ``event`` (a worker's or jobs process's SIGUSR1,
    a stop that takes too long)."""
    log_event(logger, event, level, **fields, stacks="\n" + dump_stacks())
