"""Worker process entry: start the engine, connect to Redis, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

from queues.connection import check_redis, connect, connect_blocking
from tailcut.exposition import serve_metrics
from tailcut.logs import log_event
from tailcut.loopwatch import LoopWatch, log_stacks
from tailcut.models import resolve_model
from warmup.prefixes import QaEntry, load_qa, plan
from workers.engines.base import Engine
from workers.engines.factory import start_engine
from workers.gpu_memory import GpuMemoryMonitor, LeakDetector, nvml_reader
from workers.metrics import worker_registry
from workers.prompter import Prompter
from workers.settings import WarmupSettings, WorkerSettings
from workers.worker import Worker

log = logging.getLogger("tailcut.worker")


def prefix_prompts(
    settings: WarmupSettings, entries: list[QaEntry], prompter: Prompter, engine: Engine
) -> list[list[int]]:
    """What prefix warmup runs: the plan for this engine's KV cache and context length."""
    if not entries:
        return []
    warm = plan(
        entries,
        prompter.tokenizer,
        top_n=settings.prefix_top_n,
        kv_tokens=int(engine.kv_capacity_tokens * settings.prefix_kv_share),
        max_prompt_tokens=engine.max_model_len - 1,
    )
    log_event(
        log,
        "prefix_warmup_planned",
        file=str(settings.prefix_file),
        questions=warm.questions,
        prompts=len(warm.prompts),
        skipped=warm.skipped,
    )
    return warm.prompts


async def serve(settings: WorkerSettings) -> None:
    # A bad Q&A file stops the worker before the engine spends a minute starting.
    entries = load_qa(settings.warmup.prefix_file) if settings.warmup.prefix_file is not None else []
    model_dir = resolve_model(settings.model, settings.cache_dir, progress=lambda line: log_event(log, line))
    redis = connect(settings.redis, timeout_s=settings.redis_timeout_s)
    blocking = connect_blocking(
        settings.redis, block_s=settings.read_block_ms / 1000, connect_timeout_s=settings.redis_timeout_s
    )
    await check_redis(redis)
    engine = start_engine(settings.engine, model_dir, settings.max_model_len)
    prompter = Prompter.load(model_dir)
    prefixes = prefix_prompts(settings.warmup, entries, prompter, engine)
    worker = Worker(settings, engine, redis, blocking, prompter=prompter, prefixes=prefixes)
    registry = worker_registry(worker)
    if settings.metrics_port:
        serve_metrics(registry, host=settings.metrics_host, port=settings.metrics_port)
    # GPU memory every second (absent on CPU: one log line says why); a leak is memory growing while
    # the number of running requests stays the same.
    gpu = GpuMemoryMonitor(
        nvml_reader(),
        registry=registry,
        log_path=settings.gpu_memory_log,
        detector=LeakDetector(),
        load=lambda: float(len(worker.running_ids)),
        on_warning=worker.report_event,
    )
    gpu.start()
    loop_watch = LoopWatch(
        registry, process="worker", warn_after_s=settings.loop_lag_warn_ms / 1000, on_warning=worker.report_event
    )
    loop_watch.start()
    # What start-up loaded lives as long as the process: keep the collector from walking it again
    # and again while requests allocate (the API does the same).
    gc.freeze()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, worker.stop)
    # `kill -USR1 <pid>`: every task's and thread's stack into the log (the API has GET /debug/stacks).
    loop.add_signal_handler(signal.SIGUSR1, log_stacks, log)
    try:
        await worker.run()
    finally:
        await loop_watch.stop()
        await gpu.stop()
        await engine.shutdown()
        await blocking.aclose()
        await redis.aclose()
