"""Jobs process entry (``tailcut jobs``): the arq worker that runs batch jobs, until SIGTERM/SIGINT.

No engine here: the jobs process only tokenizes, enqueues chunk requests and reads their answers; the
GPU workers run them. On a signal it cancels its running jobs' requests and hands the jobs back to
arq's queue, where the next jobs process resumes them; when Redis does not answer the hand-back, it
stops after ``CLOSE_WAIT_S`` anyway and its lease lapsing hands them back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from typing import Any

from redis.exceptions import RedisError

from jobs.arq_worker import build_worker, close_worker, run_worker
from jobs.runner import JobRunner
from jobs.settings import JobsSettings
from queues.connection import check_redis
from queues.jobs import connect_arq
from tailcut.exposition import serve_metrics
from tailcut.logs import log_event
from tailcut.loopwatch import log_stacks
from tailcut.models import resolve_model

log = logging.getLogger("tailcut.jobs")

# arq's polling loop has no error handling of its own (``run_worker`` restarts it after a Redis error):
# a generous timeout keeps a merely slow Redis from interrupting it.
ARQ_REDIS_TIMEOUT_S = 10.0
# Handing the running jobs back to arq's queue takes milliseconds; when Redis does not answer (stopping
# too, say), the stop waits this long and goes on without: the jobs process's lease then lapses, and
# the next jobs process takes its jobs within seconds (queues.jobs.JobLeases).
CLOSE_WAIT_S = 5.0
# A stop that has not ended this long after the signal logs every task's and thread's stack (the stop
# itself goes on: a supervisor's or Kubernetes' grace period decides when to kill).
SLOW_STOP_REPORT_S = 15.0


async def serve(settings: JobsSettings) -> None:
    model_dir = resolve_model(settings.model, settings.cache_dir, progress=lambda line: log_event(log, line))
    runner = await JobRunner.open(settings, model_dir)
    if settings.jobs_metrics_port:
        serve_metrics(runner.metrics.registry, host=settings.metrics_host, port=settings.jobs_metrics_port)
    try:
        await check_redis(runner.redis)
        pool = connect_arq(settings.redis, queue_name=runner.keys.arq_queue, timeout_s=ARQ_REDIS_TIMEOUT_S)
        worker = build_worker(runner, pool, handle_signals=False)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_redis_errors_in_one_line)

        def stop(signum: signal.Signals) -> None:
            if not worker.stopping:
                slow = functools.partial(log_stacks, log, "jobs_stop_slow", logging.WARNING, after_s=SLOW_STOP_REPORT_S)
                loop.call_later(SLOW_STOP_REPORT_S, slow)
            worker.handle_sig(signum)

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop, signum)
        # `kill -USR1 <pid>`: every task's and thread's stack into the log, as a worker does.
        loop.add_signal_handler(signal.SIGUSR1, log_stacks, log)
        log_event(
            log,
            "jobs_started",
            runner=settings.jobs_runner_id,
            queue=runner.keys.arq_queue,
            max_jobs=settings.jobs_max_concurrent,
        )
        leases = asyncio.create_task(runner.keep_leases(), name="job-leases")
        try:
            await run_worker(worker)
        finally:
            try:
                async with asyncio.timeout(CLOSE_WAIT_S):
                    await close_worker(worker, pool)
            except TimeoutError:
                log_event(
                    log,
                    "jobs_not_handed_back",
                    logging.WARNING,
                    after_s=CLOSE_WAIT_S,
                    why="Redis does not answer; the next jobs process takes the jobs once this one's lease lapses",
                )
                await pool.aclose(close_connection_pool=True)
            runner.stop_leases()
            await asyncio.gather(leases, return_exceptions=True)
            log_event(log, "jobs_stopped", runner=settings.jobs_runner_id)
    finally:
        await runner.close()


def _redis_errors_in_one_line(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """A background task that ended with a Redis error (arq's hand-back of a job, left behind by a stop
    that Redis did not answer) is one warning line; anything else keeps asyncio's report."""
    error = context.get("exception")
    if isinstance(error, RedisError):
        log_event(log, "redis_error_in_background", logging.WARNING, error=str(error), where=context.get("message"))
    else:
        loop.default_exception_handler(context)
