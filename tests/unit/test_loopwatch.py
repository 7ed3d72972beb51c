"""The event-loop and thread-pool watch (pure units: chosen lags, a real thread pool)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry

from tailcut.loopwatch import LoopWatch, dump_stacks


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, f"no sample {name}{labels}"
    return value


async def test_lags_are_recorded_and_a_late_loop_warns_once_a_minute_with_the_count() -> None:
    registry = CollectorRegistry()
    warnings: list[dict[str, object]] = []

    async def sink(event: dict[str, object]) -> None:
        warnings.append(event)

    watch = LoopWatch(registry, process="api", warn_after_s=0.1, on_warning=sink)
    await watch.observe(0.002, now=0.0)
    await watch.observe(0.3, now=1.0)  # late: warns
    await watch.observe(0.5, now=2.0)  # late again, within the minute: counted, not warned
    await watch.observe(0.2, now=70.0)  # a minute later: warns with the count since
    assert sample(registry, "tailcut_event_loop_lag_seconds_count", process="api") == 4
    assert sample(registry, "tailcut_event_loop_lag_seconds_bucket", process="api", le="0.005") == 1
    assert sample(registry, "tailcut_event_loop_lag_warnings_total", process="api") == 3
    assert [(w["lag_ms"], w["late_intervals"]) for w in warnings] == [(300, 1), (200, 2)]
    assert all(w["type"] == "event_loop_lag" and w["process"] == "api" for w in warnings)
    # The worst of the last minute: 0.5 s has aged out by 70 s.
    assert sample(registry, "tailcut_event_loop_lag_max_seconds", process="api") == 0.2


async def test_the_running_loop_is_measured_and_a_blocking_call_shows_as_lag() -> None:
    registry = CollectorRegistry()
    watch = LoopWatch(registry, process="worker", interval_s=0.01, warn_after_s=10)
    watch.start()
    await asyncio.sleep(0.05)
    threading.Event().wait(0.2)  # the loop is blocked for 200 ms
    await asyncio.sleep(0.05)
    await watch.stop()
    assert sample(registry, "tailcut_event_loop_lag_seconds_count", process="worker") >= 3
    assert sample(registry, "tailcut_event_loop_lag_max_seconds", process="worker") >= 0.15


async def test_stop_ends_the_watch_when_a_report_swallows_the_cancellation() -> None:
    """A shutdown hung on this: the API's report goes to Redis, and a client that swallows the
    cancellation left the watch looping while ``stop`` waited for it."""
    registry = CollectorRegistry()
    reporting = asyncio.Event()

    async def swallowing(event: dict[str, object]) -> None:
        reporting.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # as a client that swallows the cancellation does

    watch = LoopWatch(registry, process="api", interval_s=0.01, warn_after_s=-1.0, on_warning=swallowing)
    watch.start()
    await asyncio.wait_for(reporting.wait(), 5)
    stopping = asyncio.ensure_future(watch.stop())
    done, _ = await asyncio.wait({stopping}, timeout=2)
    stopping.cancel()  # a hung stop ends with the test (cancelling it cancels the watch once more)
    assert stopping in done, "stop() is still waiting on the watch that swallowed its cancellation"


async def test_a_pool_whose_threads_are_all_busy_shows_its_queue() -> None:
    registry = CollectorRegistry()
    watch = LoopWatch(registry, process="api")
    release = threading.Event()
    with ThreadPoolExecutor(max_workers=2) as pool:
        watch.watch_pool("tokenizer", pool)
        futures = [pool.submit(release.wait, 5) for _ in range(5)]
        await watch.observe(0.0)
        queued = sample(registry, "tailcut_thread_pool_queued_tasks", process="api", pool="tokenizer")
        release.set()
        for future in futures:
            future.result(timeout=5)
        await watch.observe(0.0)
        drained = sample(registry, "tailcut_thread_pool_queued_tasks", process="api", pool="tokenizer")
    assert queued == 3, "two threads busy, three items waiting"
    assert drained == 0


async def test_the_stack_dump_names_every_task_and_thread() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="stuck-thread")
    thread.start()
    sleeper = asyncio.create_task(asyncio.sleep(5), name="sleeping-task")
    await asyncio.sleep(0)
    try:
        text = dump_stacks()
    finally:
        stop.set()
        sleeper.cancel()
        thread.join()
    assert "sleeping-task" in text and "asyncio tasks" in text
    assert "thread stuck-thread" in text and "in wait" in text
