"""The arq side of a jobs process: the job function, and the arq worker that runs it (JSON serializer)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from signal import Signals
from typing import Any

from arq.connections import ArqRedis
from arq.worker import Retry, Worker, func
from redis.exceptions import RedisError

from jobs.runner import JobRunner
from queues.jobs import JOB_FUNCTION, JobSpec
from tailcut.logs import log_event

log = logging.getLogger("tailcut.jobs")

# Key of the runner in arq's per-worker ``ctx``.
RUNNER_CTX_KEY = "tailcut_runner"
# A job whose jobs process keeps stopping under it is run at most this many times.
JOB_MAX_TRIES = 5
# A job that Redis failed under runs again after this long.
REDIS_RETRY_DEFER_S = 2.0
# How long a stop keeps cancelling arq's polling loop (or a job) before it gives up on it (and says so).
STOP_WAIT_S = 10.0
CANCEL_EVERY_S = 0.2


async def analyze_logs(ctx: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """The arq job function. Redis failing under a job runs it again (up to ``JOB_MAX_TRIES``)."""
    runner: JobRunner = ctx[RUNNER_CTX_KEY]
    try:
        return await runner.run(ctx["job_id"], JobSpec.from_payload(payload), attempt=int(ctx.get("job_try", 1)))
    except RedisError as exc:
        raise Retry(defer=REDIS_RETRY_DEFER_S) from exc


class JobsWorker(Worker):
    """arq's worker, remembering that it was told to stop: ``run_worker`` starts arq's loop again
    after a Redis error, and must not when the stop came first; and it waits for the stop itself,
    not only for arq's loop to end (arq's stop cancels that loop once, and a cancel can be lost)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stop_requested = asyncio.Event()

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    def request_stop(self) -> None:
        """Stop picking jobs (also in a loop that is still running until the cancel reaches it);
        ``run_worker`` ends arq's loop and returns (within ``STOP_WAIT_S``)."""
        self.allow_pick_jobs = False
        self.stop_requested.set()

    def handle_sig(self, signum: Signals) -> None:
        self.request_stop()
        super().handle_sig(signum)


def build_worker(runner: JobRunner, pool: ArqRedis, *, handle_signals: bool) -> JobsWorker:
    """The arq worker of a jobs process. Results are never logged (they quote the logs)."""
    settings = runner.settings
    return JobsWorker(
        functions=[func(analyze_logs, name=JOB_FUNCTION, max_tries=JOB_MAX_TRIES)],
        queue_name=runner.keys.arq_queue,
        redis_pool=pool,
        handle_signals=handle_signals,
        max_jobs=settings.jobs_max_concurrent,
        job_timeout=settings.jobs_timeout_s,
        keep_result=settings.jobs_result_ttl_s,
        poll_delay=settings.jobs_poll_delay_s,
        allow_abort_jobs=True,
        job_serializer=pool.job_serializer,
        job_deserializer=pool.job_deserializer,
        ctx={RUNNER_CTX_KEY: runner},
        log_results=False,
    )


async def run_worker(worker: JobsWorker) -> None:
    """Run arq's polling loop until the worker is told to stop, then end it and return.

    arq's loop has no error handling of its own: when Redis fails under it (a restart, a Sentinel
    failover while no primary is known), it ends with the error. The jobs it runs go on (each handles
    Redis errors itself), and the loop starts again after a pause, so the process follows Redis back
    without a restart — unless it was told to stop meanwhile. The stop is waited for beside the loop,
    not through it: arq's own stop cancels the loop once, and redis-py can lose a cancel that lands
    mid-command (the loop then polls on, and a process that waited for it never exited)."""
    while not worker.stopping:
        main = worker.main_task = asyncio.ensure_future(worker.main())
        stop = asyncio.ensure_future(worker.stop_requested.wait())
        try:
            await asyncio.wait({main, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            main.cancel()
            raise
        finally:
            stop.cancel()
        error = main.exception() if main.done() and not main.cancelled() else None
        if worker.stopping or main.cancelled():
            break  # an error that came with the stop is the stop's (Redis going away with it)
        if error is None:
            return  # arq's loop ended by itself (burst mode)
        if not isinstance(error, RedisError):
            raise error
        log_event(log, "jobs_redis_unavailable", logging.WARNING, error=str(error), retry_s=REDIS_RETRY_DEFER_S)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REDIS_RETRY_DEFER_S):
                await worker.stop_requested.wait()
    await stop_main_task(worker)


async def close_worker(worker: JobsWorker, pool: ArqRedis) -> None:
    """Stop the arq worker: cancel its running jobs (each cancels its requests and goes back to the
    queue: arq's hand-back after the cancel is not cancelled again) and close the pool. Does what
    ``Worker.close()`` does, with redis-py's ``aclose``; waits ``STOP_WAIT_S`` at most for each part."""
    worker.request_stop()
    jobs = [task for task in worker.tasks.values() if not task.done()]
    for task in jobs:
        if not task.cancelling():  # once: arq's stop (``handle_sig``) may have cancelled it already
            task.cancel()
    await stop_main_task(worker)
    if jobs:
        _done, stuck = await asyncio.wait(jobs, timeout=STOP_WAIT_S)
        if stuck:
            log_event(log, "jobs_did_not_stop", logging.WARNING, jobs=len(stuck), waited_s=STOP_WAIT_S)
    with contextlib.suppress(RedisError):
        await pool.delete(worker.health_check_key)
    await pool.aclose(close_connection_pool=True)


async def stop_main_task(worker: JobsWorker) -> None:
    """Cancel arq's polling loop until it has ended, for ``STOP_WAIT_S`` at most (then say so and leave
    it). One cancel is not always enough: redis-py can swallow a CancelledError that lands in the
    middle of a command, and the loop then polls on."""
    main = worker.main_task
    if main is None:
        return
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + STOP_WAIT_S
    while not main.done() and loop.time() < give_up_at:
        main.cancel()
        await asyncio.wait({main}, timeout=CANCEL_EVERY_S)
    if not main.done():
        log_event(log, "jobs_poll_loop_did_not_stop", logging.WARNING, waited_s=STOP_WAIT_S)
