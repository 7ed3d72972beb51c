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
# How long a stop keeps cancelling arq's polling loop before it gives up on it (and says so).
MAIN_TASK_STOP_S = 10.0
MAIN_TASK_CANCEL_EVERY_S = 0.2


async def analyze_logs(ctx: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """The arq job function. Redis failing under a job runs it again (up to ``JOB_MAX_TRIES``)."""
    runner: JobRunner = ctx[RUNNER_CTX_KEY]
    try:
        return await runner.run(ctx["job_id"], JobSpec.from_payload(payload), attempt=int(ctx.get("job_try", 1)))
    except RedisError as exc:
        raise Retry(defer=REDIS_RETRY_DEFER_S) from exc


class JobsWorker(Worker):
    """arq's worker, remembering that it was told to stop: ``run_worker`` starts arq's loop again
    after a Redis error, and must not when the stop came first (arq's stop cancels only the main
    task it has then, which a Redis error may already have ended)."""

    stopping = False

    def handle_sig(self, signum: Signals) -> None:
        self.stopping = True
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
    """Run the arq worker until it is stopped; arq stops by cancelling its own main task.

    arq's polling loop has no error handling of its own: when Redis fails under it (a restart, a
    Sentinel failover while no primary is known), its main task ends with the error. The jobs it
    runs go on (each handles Redis errors itself), and the loop starts again after a pause, so the
    process follows Redis back without a restart — unless it was told to stop meanwhile (a test's
    teardown once hung on an arq loop started again after ``close_worker``)."""
    while not worker.stopping:
        try:
            await worker.async_run()
            return
        except RedisError as exc:
            if worker.stopping:
                return
            log_event(log, "jobs_redis_unavailable", logging.WARNING, error=str(exc), retry_s=REDIS_RETRY_DEFER_S)
            # The pause stands as arq's main task, so a stop signal meanwhile cancels it as it would the loop.
            worker.main_task = asyncio.ensure_future(asyncio.sleep(REDIS_RETRY_DEFER_S))
            try:
                await worker.main_task
            except asyncio.CancelledError:
                if _cancelled_from_outside():
                    raise
                return
        except asyncio.CancelledError:
            if _cancelled_from_outside():
                raise
            return


def _cancelled_from_outside() -> bool:
    """Whether the running task itself is being cancelled (not arq cancelling its main task to stop)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def close_worker(worker: JobsWorker, pool: ArqRedis) -> None:
    """Stop the arq worker: cancel its running jobs (each cancels its requests and goes back to the
    queue) and close the pool. Does what ``Worker.close()`` does, with redis-py's ``aclose``."""
    worker.stopping = True
    for task in worker.tasks.values():
        task.cancel()
    await _stop_main_task(worker)
    await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
    with contextlib.suppress(RedisError):
        await pool.delete(worker.health_check_key)
    await pool.aclose(close_connection_pool=True)


async def _stop_main_task(worker: JobsWorker) -> None:
    """Cancel arq's polling loop until it has ended. One cancel is not always enough: redis-py can
    swallow a CancelledError that lands in the middle of a command, and the loop then polls on (a
    test's teardown hung on it for minutes)."""
    main = worker.main_task
    if main is None:
        return
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + MAIN_TASK_STOP_S
    while not main.done() and loop.time() < give_up_at:
        main.cancel()
        await asyncio.wait({main}, timeout=MAIN_TASK_CANCEL_EVERY_S)
    if not main.done():
        log_event(log, "jobs_poll_loop_did_not_stop", logging.WARNING, waited_s=MAIN_TASK_STOP_S)
