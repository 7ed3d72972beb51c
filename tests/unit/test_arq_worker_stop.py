"""``jobs.arq_worker.run_worker`` starts arq's loop again after a Redis error, but not once told to stop,
and ``close_worker`` stops a loop that swallowed its first cancel (pure: arq's loop is replaced by one
that fails as Redis going away under a stop does, or that swallows a cancel as redis-py can)."""

from __future__ import annotations

import asyncio
from typing import Any

from arq.worker import func
from redis.exceptions import ConnectionError as RedisConnectionError

from jobs.arq_worker import JobsWorker, close_worker, run_worker


async def nothing(ctx: dict[str, Any]) -> None:
    return None


class FailingLoop(JobsWorker):
    """arq's loop ends with a Redis error each time; ``stop_at`` runs: the stop comes with the first."""

    def __init__(self, *, stop_at: int | None) -> None:
        super().__init__(functions=[func(nothing, name="nothing")], handle_signals=False)
        self.runs = 0
        self.stop_at = stop_at

    async def async_run(self) -> None:
        self.runs += 1
        if self.runs == self.stop_at:
            self.stopping = True  # as close_worker or SIGTERM would, while Redis fails under the loop
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
    worker.stopping = True
    assert worker.main_task is not None
    worker.main_task.cancel()
    async with asyncio.timeout(5):
        await task
    assert worker.runs == 2


class SwallowingLoop(JobsWorker):
    """arq's polling loop whose first cancel lands in a library that swallows it, so it polls on."""

    def __init__(self) -> None:
        super().__init__(functions=[func(nothing, name="nothing")], handle_signals=False)
        self.swallowed = 0

    async def main(self) -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if self.swallowed:
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
