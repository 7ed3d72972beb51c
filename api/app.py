"""The FastAPI application and its lifecycle (set up in order, torn down in reverse)."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from admission.admitter import Admitter
from admission.request import ServedModel
from admission.shedding import Backlog
from admission.tokenizer import PromptTokenizer
from api import admin, debug, errors, health, jobs_routes, openai_routes, openapi, replay, status_routes, tokenization
from api.answers import AnswerCache, model_identity
from api.auth import KeyCache
from api.bodylimit import BodyLimit
from api.fastpath import FastPath
from api.limits import LEASE_S
from api.metrics import ApiMetrics
from api.metrics_port import MetricsPortOnly
from api.seeded import SeededAnswers
from api.settings import ApiSettings
from api.shutdown import Drain
from api.state import ApiState
from api.status import StatusWindow
from jobs.settings import JobsSettings
from queues import events
from queues.answers import AnswerStore
from queues.apikeys import KeyStore
from queues.connection import check_redis, connect, connect_blocking
from queues.jobs import connect_arq
from queues.keys import Keys
from queues.limits import TenantLimits
from queues.replies import ReplyRouter
from tailcut.errors import ServiceUnavailableError
from tailcut.logs import log_event
from tailcut.loopwatch import LoopWatch
from tailcut.models import resolve_model

log = logging.getLogger("tailcut.api")

# How long start-up waits for the reply-channel subscription before serving 503s until it exists.
SUBSCRIBE_WAIT_S = 5.0


class TailcutApp(FastAPI):
    """FastAPI with tailcut's own layers in front of it rather than inside Starlette's middleware stack:
    the metrics port's check, the body limit, then the generation routes' fast path (``api.fastpath``),
    which hands everything it does not take to FastAPI. A streamed reply's task then runs under four
    frames fewer (FastAPI's and Starlette's calls, the error middleware and its wrapper of ``send``),
    which every write and every wake-up of the task passed through: a few of those per chunk.

    The fast path renders its endpoint's errors as the app's handlers do, so nothing it answers needs
    the error middleware; a body it cannot parse goes to FastAPI, whose handlers answer it."""

    def __init__(self, settings: ApiSettings, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        edge: ASGIApp = FastPath(self.framework)
        edge = BodyLimit(edge, max_bytes=settings.max_body_bytes)
        if settings.api_metrics_port:
            edge = MetricsPortOnly(edge, port=settings.api_metrics_port)
        self.edge = edge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self  # what Starlette sets, for ``Request.app`` on the fast path
        await self.edge(scope, receive, send)

    async def framework(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI itself: its middleware stack, routing and handlers."""
        await super().__call__(scope, receive, send)


def create_app(
    settings: ApiSettings, *, model_dir: Path | None = None, jobs_settings: JobsSettings | None = None
) -> FastAPI:
    """The app; ``jobs_settings`` (limits and defaults of ``/v1/jobs``) are read from the environment
    when not given. Redis and key prefix always come from ``settings``."""
    jobs = jobs_settings or JobsSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        folder = model_dir or resolve_model(settings.model, settings.cache_dir)
        model = ServedModel.of(folder, settings)
        tokenizer = PromptTokenizer(folder, num_threads=settings.tokenizer_threads)
        keys = Keys(settings.key_prefix)
        redis = connect(settings.redis, timeout_s=settings.redis_timeout_s)
        pubsub_redis = connect_blocking(settings.redis, block_s=1.0, connect_timeout_s=settings.redis_timeout_s)
        try:
            await check_redis(redis)
        except ServiceUnavailableError as exc:
            # Start anyway: requests get a clear 503 and /readyz says why until Redis is back.
            log_event(log, "redis_unavailable_at_start", logging.WARNING, error=exc.message)
        router = ReplyRouter(redis, pubsub_redis, keys, settings.api_id, poll_max_s=settings.reply_poll_max_s)
        await router.start(wait_s=SUBSCRIBE_WAIT_S)
        arq = connect_arq(settings.redis, queue_name=keys.arq_queue, timeout_s=settings.redis_timeout_s)
        backlog = Backlog(redis, keys, interval_s=settings.shed_probe_interval_s)
        backlog.start()
        metrics = ApiMetrics(settings.slo_targets())
        metrics.watch_queues(backlog)
        status = StatusWindow(metrics.exposed, window_s=settings.status_window_s)
        status.start()
        answers = tiny_answers = seeded = None
        if settings.cache_enabled and settings.cache_seed_file is not None:
            seeded = SeededAnswers.load(
                settings.cache_seed_file,
                tokenizer.tokenizer,
                top_n=settings.cache_seed_top_n,
                registry=metrics.registry,
            )
        if settings.cache_enabled:
            model_id = model_identity(model.name, folder)
            answers = AnswerCache(AnswerStore(redis, keys, settings.cache_config()), model_id, metrics.registry)
            if settings.cache_tiny_max_entries:
                tiny = AnswerStore(redis, keys, settings.cache_config(tiny=True), pool="tiny")
                tiny_answers = AnswerCache(tiny, model_id, metrics.registry, shared=True)
        state = ApiState(
            settings=settings,
            keys=keys,
            redis=redis,
            pubsub_redis=pubsub_redis,
            router=router,
            admitter=Admitter(settings.admission_config(), model, tokenizer=tokenizer, queue_depth=backlog),
            jobs_settings=jobs,
            arq=arq,
            backlog=backlog,
            drain=Drain(settings.shutdown_grace_s),
            metrics=metrics,
            status=status,
            answers=answers,
            tiny_answers=tiny_answers,
            seeded=seeded,
            key_cache=KeyCache(KeyStore(redis, keys, settings.auth_secret), settings.auth_secret)
            if settings.auth_required and settings.auth_secret
            else None,
            limits=TenantLimits(redis, keys, lease_ms=LEASE_S * 1000) if settings.auth_required else None,
        )
        app.state.tailcut = state

        async def report(event: dict[str, object]) -> None:
            await events.publish(redis, keys, event, source={"api": settings.api_id})

        loop_watch = LoopWatch(
            state.metrics.registry, process="api", warn_after_s=settings.loop_lag_warn_ms / 1000, on_warning=report
        )
        loop_watch.watch_pool("tokenizer", tokenizer.pool)
        loop_watch.start()
        # Everything loaded at start-up (the tokenizer, transformers, FastAPI's routes) lives as long as the
        # process: move it out of the collector's generations, or every full collection walks it again while
        # thousands of events per second allocate.
        gc.freeze()
        log_event(log, "api_started", api_id=settings.api_id, model=model.name, max_model_len=model.max_model_len)
        try:
            yield
        finally:
            await loop_watch.stop()
            await status.stop()
            await state.wait_background()
            await backlog.stop()
            await arq.aclose(close_connection_pool=True)
            await router.stop()
            await pubsub_redis.aclose()
            await redis.aclose()
            tokenizer.close()
            log_event(log, "api_stopped", api_id=settings.api_id)

    app = TailcutApp(settings, title="tailcut", version="0.1.0", lifespan=lifespan)
    errors.install(app)
    openapi.install(app)
    app.include_router(health.router)
    app.include_router(openai_routes.router)
    app.include_router(tokenization.router)
    app.include_router(jobs_routes.router)
    app.include_router(replay.router)
    app.include_router(debug.router)
    app.include_router(admin.router)
    app.include_router(status_routes.router)
    return app
