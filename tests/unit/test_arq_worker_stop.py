"""``jobs.arq_worker.run_worker`` starts arq's loop again after a Redis error, but not once told to stop;
a stop (a signal, or ``close_worker``) ends a loop that swallowed its first cancel, and one that never
ends is left behind after ``STOP_WAIT_S`` rather than waited for (pure: arq's loop is replaced by one
that fails as Redis going away under a stop does, or that swallows cancels as redis-py can)."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

import pytest
from arq.worker import func
from redis.exceptions import ConnectionError as RedisConnectionError

from jobs import arq_worker
from jobs.arq_worker import JobsWorker, close_worker, run_worker


async def nothing(ctx: dict[str, Any]) -> None:
    return None


class FailingLoop(JobsWorker):
    """arq's loop ends with a Redis error each time; ``stop_at`` runs: the stop comes with the first."""

    def __init__(self, *, stop_at: int | None) -> None:
        super().__init__(functions=[func(nothing, name="nothing")], handle_signals=False)
        self.runs = 0
        self.stop_at = stop_at

    async def main(self) -> None:
        self.runs += 1
        if self.runs == self.stop_at:
            self.request_stop()  # as close_worker or SIGTERM would, while Redis fails under the loop
        raise RedisConnectionError("Connection closed by server.")


async def test_a_stop_that_came_with_a_redis_error_is_not_followed_by_a_new_loop() -> None:
    worker = FailingLoop(stop_at=1)
    async with asyncio.timeout(1):  # without the check, it pauses 2 s and runs arq's loop again
        await run_worker(worker)
    assert worker.runs == 1


async def test_without_a_stop_the_loop_starts_again_after_a_redis_error() -> None:
    worker = FailingLoop(stop_at=None)
    task = asyncio.create_task(run_worker(worker))
    await asyncio.sleep(2.5)  # one pause of REDIS_RETRY_DEFER_S
    worker.request_stop()
    async with asyncio.timeout(1):  # the stop ends the second pause
        await task
    assert worker.runs == 2


class SwallowingLoop(JobsWorker):
    """arq's polling loop whose first ``swallows`` cancels land in a library that swallows them, so it
    polls on."""

    def __init__(self, swallows: int = 1) -> None:
        super().__init__(functions=[func(nothing, name="nothing")], handle_signals=False)
        self.swallows = swallows
        self.swallowed = 0

    async def main(self) -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if self.swallowed >= self.swallows:
                    raise
                self.swallowed += 1


class ClosedPool:
    async def delete(self, *_keys: str) -> None:
        return None

    async def aclose(self, *, close_connection_pool: bool) -> None:
        return None


async def test_close_stops_a_polling_loop_that_swallowed_its_first_cancel() -> None:
    worker = SwallowingLoop()
    running = asyncio.create_task(run_worker(worker))
    await asyncio.sleep(0.05)
    async with asyncio.timeout(5):  # one cancel only: the loop polls on, and this waits forever
        await close_worker(worker, ClosedPool())  # type: ignore[arg-type]
        await running
    assert worker.swallowed == 1 and worker.main_task is not None and worker.main_task.done()


async def test_a_signal_ends_the_run_though_the_loop_swallowed_arqs_one_cancel() -> None:
    """``tailcut jobs`` on SIGTERM: arq's ``handle_sig`` cancels its loop once; the run must end anyway."""
    worker = SwallowingLoop()
    running = asyncio.create_task(run_worker(worker))
    await asyncio.sleep(0.05)
    worker.handle_sig(signal.SIGTERM)
    async with asyncio.timeout(5):  # waiting on arq's loop alone, the run never ends
        await running
    assert worker.swallowed == 1 and worker.main_task is not None and worker.main_task.done()


async def test_a_loop_that_never_ends_is_left_behind_after_the_stop_wait_picking_nothing_and_said_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(arq_worker, "STOP_WAIT_S", 0.5)
    worker = SwallowingLoop(swallows=1_000_000)
    running = asyncio.create_task(run_worker(worker))
    await asyncio.sleep(0.05)
    try:
        with caplog.at_level(logging.WARNING, logger="tailcut.jobs"):
            worker.handle_sig(signal.SIGTERM)
            async with asyncio.timeout(5):
                await running
        assert worker.main_task is not None and not worker.main_task.done()
        assert "jobs_poll_loop_did_not_stop" in caplog.text
        assert not worker.allow_pick_jobs  # the loop left behind starts no job
    finally:
        worker.swallows = 0  # let the test's loop end it
        if worker.main_task is not None:
            worker.main_task.cancel()
            await asyncio.wait({worker.main_task}, timeout=1)
