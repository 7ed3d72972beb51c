"""Jobs process entry (``tailcut jobs``): the arq worker that runs batch jobs, until SIGTERM/SIGINT.

No engine here: the jobs process only tokenizes, enqueues chunk requests and reads their answers; the
GPU workers run them. On a signal it cancels its running jobs' requests and hands the jobs back to
arq's queue, where the next jobs process resumes them.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from jobs.arq_worker import build_worker, close_worker, run_worker
from jobs.runner import JobRunner
from jobs.settings import JobsSettings
from queues.connection import check_redis
from queues.jobs import connect_arq
from tailcut.exposition import serve_metrics
from tailcut.logs import log_event
from tailcut.models import resolve_model

log = logging.getLogger("tailcut.jobs")

# arq's polling loop has no error handling of its own (``run_worker`` restarts it after a Redis error):
# a generous timeout keeps a merely slow Redis from interrupting it.
ARQ_REDIS_TIMEOUT_S = 10.0


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
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, worker.handle_sig, signum)
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
            await close_worker(worker, pool)
            leases.cancel()
            await asyncio.gather(leases, return_exceptions=True)
            log_event(log, "jobs_stopped", runner=settings.jobs_runner_id)
    finally:
        await runner.close()
