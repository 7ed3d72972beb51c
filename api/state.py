"""What the API's routes share for the life of the process."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from arq.connections import ArqRedis

from admission.admitter import Admitter
from admission.request import ServedModel
from admission.shedding import Backlog
from api.answers import AnswerCache
from api.metrics import ApiMetrics
from api.seeded import SeededAnswers
from queues.limits import TenantLimits

if TYPE_CHECKING:
    from api.auth import KeyCache
from api.settings import ApiSettings
from api.shutdown import Drain
from api.status import StatusWindow
from jobs.settings import JobsSettings
from queues.keys import Keys
from queues.replies import ReplyRouter


@dataclass
class ApiState:
    settings: ApiSettings
    keys: Keys
    redis: aioredis.Redis
    pubsub_redis: aioredis.Redis
    router: ReplyRouter
    admitter: Admitter
    # Batch jobs: their settings and the arq client (JSON serializer) that enqueues and inspects them.
    jobs_settings: JobsSettings
    arq: ArqRedis
    backlog: Backlog
    drain: Drain
    metrics: ApiMetrics
    # The status page's window over the metrics (``api.status``).
    status: StatusWindow
    # The answer cache of deterministic requests (None: TAILCUT_CACHE_ENABLED=false).
    answers: AnswerCache | None
    # The Q&A file's own answers, served marked `seeded` (None: TAILCUT_CACHE_SEED_FILE unset).
    seeded: SeededAnswers | None
    # The API keys in Redis, as this process sees them (None: TAILCUT_AUTH_REQUIRED is off).
    key_cache: KeyCache | None
    # Per-tenant limits in Redis (None: TAILCUT_AUTH_REQUIRED is off: without keys there is no tenant to limit).
    limits: TenantLimits | None
    # The shared pool of tiny requests' answers (None: the cache is off or the pool's size is 0).
    tiny_answers: AnswerCache | None
    _background: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def model(self) -> ServedModel:
        return self.admitter.model

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` detached from the request (for example a cancel sent while the request is
        being torn down), keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait_background(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
