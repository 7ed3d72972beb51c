"""Batch log analysis as an arq job: fan a log's chunks out as background-tier requests, gather the answers.

A job's chunks go through the same intake streams and GPU workers as every other request, tier
``background``, admitted by the same ``admission.admitter.Admitter`` as the API's requests (tokens,
bucket, predicted output, deadline), which learns their real lengths as they finish. The jobs process
owns one ``ReplyRouter`` (reply channel ``tc:reply:{jobs_runner_id}``) shared by all its jobs; each job
keeps at most ``jobs_max_in_flight`` requests queued or running.

Stopping: arq cancels the job's task, both for ``DELETE /v1/jobs/{id}`` (arq abort) and when the jobs
process stops. Either way the runner cancels every request it has in flight (the worker aborts them in
the engine) and enqueues nothing more. An abort ends the job as ``aborted``; a stop puts it back in
arq's queue, and the next run skips the chunks already answered (kept in ``tc:job:{id}:chunks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from admission.admitter import Admitter
from admission.request import ChatPrompt, GenerationRequest, ServedModel
from admission.tokenizer import PromptTokenizer
from jobs.metrics import JobsMetrics
from jobs.prompts import chunk_messages, reduce_messages
from jobs.settings import JobsSettings
from queues import intake, output
from queues.connection import connect, connect_blocking
from queues.jobs import ARQ_START_WINDOW_S, Answer, Chunk, JobLeases, JobSpec, JobStore
from queues.keys import Keys
from queues.messages import SamplingOptions
from queues.replies import ReplyRouter
from tailcut.errors import InvalidRequestError, JobFailedError
from tailcut.logs import log_event

log = logging.getLogger("tailcut.jobs")

# How long start-up waits for the reply-channel subscription.
SUBSCRIBE_WAIT_S = 5.0
# A jobs process renews its lease this often; it lapses after ``JobLeases.LEASE_BEATS`` of them.
LEASE_BEAT_S = 1.0
# Rounds of shortening the chunk answers until the combining prompt fits the context.
MAX_FIT_ROUNDS = 8


class JobRunner:
    """Runs jobs in the jobs process: admission, the reply router, Redis clients, the progress store."""

    def __init__(
        self,
        settings: JobsSettings,
        *,
        redis: aioredis.Redis,
        pubsub_redis: aioredis.Redis,
        router: ReplyRouter,
        admitter: Admitter,
    ) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.redis = redis
        self._pubsub_redis = pubsub_redis
        self.router = router
        self.admitter = admitter
        self.store = JobStore(redis, self.keys)
        self.metrics = JobsMetrics()
        # arq keeps a started job's in-progress mark this long (its job timeout plus 10 s).
        self.leases = JobLeases(
            redis, self.keys, settings.jobs_runner_id, beat_s=LEASE_BEAT_S, in_progress_s=settings.jobs_timeout_s + 10
        )
        self._leases_stop = asyncio.Event()

    async def keep_leases(self) -> None:
        """Renew this process's lease and run again, at once, the jobs of jobs processes that are gone,
        until ``stop_leases()``; then the lease is released, so others need not wait for it to lapse.
        The loop ends on that call, not on a cancel: redis-py can lose a cancel that lands mid-command,
        and the loop would run on (a stop that waited for it never ended)."""
        try:
            while not self._leases_stop.is_set():
                try:
                    await self.leases.renew()
                    for job_id in await self.leases.reclaim():
                        log_event(log, "job_reclaimed", logging.WARNING, job=job_id, why="its jobs process is gone")
                except RedisError as exc:
                    log_event(log, "job_lease_failed", logging.WARNING, error=str(exc))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(LEASE_BEAT_S):
                        await self._leases_stop.wait()
        finally:
            with contextlib.suppress(RedisError):
                await self.leases.release()

    def stop_leases(self) -> None:
        """End ``keep_leases`` (after the Redis command it is in, if any) and release the lease."""
        self._leases_stop.set()

    @property
    def model(self) -> ServedModel:
        return self.admitter.model

    @classmethod
    async def open(cls, settings: JobsSettings, model_dir: Path) -> JobRunner:
        """Connect, subscribe the reply channel and load the tokenizer. Chunk requests are admitted with
        the admission settings in ``settings`` (the same ``TAILCUT_*`` variables the API reads). Nothing
        here sheds: a job's requests wait their turn in the background tier."""
        tokenizer = PromptTokenizer(model_dir, num_threads=settings.tokenizer_threads)
        admitter = Admitter(settings.admission_config(), ServedModel.of(model_dir, settings), tokenizer=tokenizer)
        redis = connect(settings.redis, timeout_s=settings.redis_timeout_s)
        pubsub_redis = connect_blocking(settings.redis, block_s=1.0, connect_timeout_s=settings.redis_timeout_s)
        router = ReplyRouter(
            redis,
            pubsub_redis,
            Keys(settings.key_prefix),
            settings.jobs_runner_id,
            poll_max_s=settings.reply_poll_max_s,
        )
        await router.start(wait_s=SUBSCRIBE_WAIT_S)
        return cls(settings, redis=redis, pubsub_redis=pubsub_redis, router=router, admitter=admitter)

    async def close(self) -> None:
        await self.router.stop()
        await self._pubsub_redis.aclose()
        await self.redis.aclose()
        if self.admitter.tokenizer is not None:
            self.admitter.tokenizer.close()

    @property
    def _progress_ttl_s(self) -> int:
        return int(ARQ_START_WINDOW_S + self.settings.jobs_timeout_s + self.settings.jobs_result_ttl_s)

    async def run(self, job_id: str, spec: JobSpec, *, attempt: int = 1) -> dict[str, Any]:
        """Run every chunk not answered yet, then the combining request; returns the job's result."""
        started = time.monotonic()
        chunks = spec.chunks()
        answers = await self.store.answers(job_id)
        await self.store.mark_running(
            job_id,
            done=sum(answer.ok for answer in answers.values()),
            failed=sum(not answer.ok for answer in answers.values()),
            attempt=attempt,
            runner=self.settings.jobs_runner_id,
        )
        log_event(log, "job_started", job=job_id, chunks=len(chunks), resumed=len(answers), attempt=attempt)
        in_flight: set[str] = set()
        self.metrics.running.inc()
        try:
            await self._map(job_id, spec, chunks, answers, in_flight)
            combined: dict[str, Any] | None = None
            if spec.reduce:
                combined = await self._reduce(job_id, spec, [answers[chunk.index] for chunk in chunks], in_flight)
        except asyncio.CancelledError:
            # Shielded: the cancels go out even if arq cancels this task once more meanwhile.
            await asyncio.shield(self._cancel(in_flight))
            progress = None
            with contextlib.suppress(RedisError):
                progress = await self.store.read(job_id)
                if progress is not None and progress.abort_requested:
                    await self.store.finish(job_id, "aborted", ttl_s=self.settings.jobs_result_ttl_s)
                else:
                    await self.store.set_status(job_id, "queued")  # arq runs it again
            aborted = progress is not None and progress.abort_requested
            self.metrics.jobs.labels("aborted" if aborted else "stopped").inc()
            log_event(log, "job_stopped", job=job_id, cancelled_requests=len(in_flight), ms=_ms_since(started))
            raise
        except Exception as exc:
            await self._cancel(in_flight)
            if redis_failure(exc):
                # Redis went away (or timed out) under the job — in one chunk's task, say: it is not the
                # job's failure. arq runs it again (the answers kept so far are not asked again); if
                # this process stops meanwhile, its lease lapses and another jobs process takes the job
                # (``queues.jobs.JobLeases``).
                self.metrics.jobs.labels("stopped").inc()
                log_event(
                    log, "job_interrupted", logging.WARNING, job=job_id, error=_describe(exc), ms=_ms_since(started)
                )
                if isinstance(exc, RedisError):
                    raise
                raise RedisError(_describe(exc)) from exc
            error = _describe(exc)
            with contextlib.suppress(RedisError):
                await self.store.finish(job_id, "failed", ttl_s=self.settings.jobs_result_ttl_s, error=error)
            self.metrics.jobs.labels("failed").inc()
            log_event(log, "job_failed", logging.WARNING, job=job_id, error=error, ms=_ms_since(started))
            raise JobFailedError(error) from exc
        finally:
            self.metrics.running.dec()
        result = aggregate(chunks, answers, combined)
        await self.store.finish(job_id, "complete", ttl_s=self.settings.jobs_result_ttl_s)
        self.metrics.jobs.labels("complete").inc()
        log_event(
            log, "job_finished", job=job_id, chunks=len(chunks), failed=result["num_failed"], ms=_ms_since(started)
        )
        return result

    async def _map(
        self, job_id: str, spec: JobSpec, chunks: list[Chunk], answers: dict[int, Answer], in_flight: set[str]
    ) -> None:
        todo = iter([chunk for chunk in chunks if chunk.index not in answers])
        num_lanes = min(self.settings.jobs_max_in_flight, len(chunks) - len(answers))

        async def lane() -> None:
            for chunk in todo:  # shared by the lanes: each chunk is taken once
                messages = chunk_messages(spec.instruction, chunk, len(chunks))
                answer = await self._ask(job_id, spec, messages, in_flight)
                answers[chunk.index] = answer
                await self.store.record(job_id, chunk.index, answer, ttl_s=self._progress_ttl_s)

        async with asyncio.TaskGroup() as group:
            for _ in range(num_lanes):
                group.create_task(lane())

    async def _ask(self, job_id: str, spec: JobSpec, messages: list[dict[str, str]], in_flight: set[str]) -> Answer:
        """One background-tier chat request through the intake streams; its answer or its error.

        The request id stays in ``in_flight`` unless the request reaches its terminal event, so a
        cancelled job knows what to cancel.
        """
        request = GenerationRequest(
            prompt=ChatPrompt(messages),
            reply_to=self.settings.jobs_runner_id,
            tier="background",
            tenant=spec.tenant,
            max_tokens=spec.max_tokens,
            sampling=SamplingOptions(temperature=spec.temperature, ignore_eos=spec.ignore_eos),
        )
        try:
            message = await self.admitter.admit(request)
        except InvalidRequestError as exc:
            return Answer(error_code=exc.code or "invalid_request", error_message=exc.message)

        async def alive() -> bool:  # a Redis that lost the job lost its requests too
            return bool(await self.redis.exists(self.keys.job(job_id)))

        stream = self.router.open(message.id, alive=alive)
        in_flight.add(message.id)
        self.metrics.in_flight.inc()
        texts: list[str] = []
        answer = Answer(error_code="no_final_event", error_message="the output stream ended without a final event")
        try:
            await intake.enqueue(
                self.redis,
                self.keys,
                message,
                replicas=self.settings.intake_replicas,
                wait_ms=self.settings.intake_replica_wait_ms,
            )
            async for event in stream.events():
                if event.type == "chunk":
                    texts.append(event.text)
                elif event.type == "final":
                    self.admitter.observe(message, event.completion_tokens or 0)
                    answer = Answer(
                        text="".join(texts),
                        finish_reason=event.finish_reason,
                        prompt_tokens=event.prompt_tokens or 0,
                        completion_tokens=event.completion_tokens or 0,
                    )
                    break
                elif event.type == "error":
                    answer = Answer(
                        text="".join(texts),
                        prompt_tokens=len(message.prompt_token_ids),
                        error_code=event.error_code or "error",
                        error_message=event.error_message,
                    )
                    break
        finally:
            stream.close()
            self.metrics.in_flight.dec()
        in_flight.discard(message.id)
        self.metrics.chunks.labels("ok" if answer.ok else "failed").inc()
        return answer

    async def _reduce(self, job_id: str, spec: JobSpec, answers: list[Answer], in_flight: set[str]) -> dict[str, Any]:
        """One request that combines the chunk answers. When they do not fit the context together,
        each is shortened to the same length, and the result says how many were."""
        texts = [answer.text if answer.ok else f"(no answer: {answer.error_message})" for answer in answers]
        budget = self.model.max_model_len - spec.max_tokens
        shown = texts
        limit: int | None = None
        fits = False
        for _ in range(MAX_FIT_ROUNDS):
            shown = [text if limit is None else text[:limit] for text in texts]
            num_tokens = len(await self.admitter.prompt_ids(ChatPrompt(reduce_messages(spec.instruction, shown))))
            if num_tokens <= budget:
                fits = True
                break
            longest = max((len(text) for text in shown), default=0)
            limit = int(longest * budget / num_tokens * 0.9)
            if limit < 1:
                break
        if fits:
            answer = await self._ask(job_id, spec, reduce_messages(spec.instruction, shown), in_flight)
        else:
            answer = Answer(
                error_code="context_length_exceeded",
                error_message=(
                    f"the {len(texts)} chunk answers do not fit one combining request of "
                    f"{self.model.max_model_len} tokens; use fewer chunks (raise chunk_lines) or lower max_tokens"
                ),
            )
        await self.store.count(job_id, answer)
        num_shortened = sum(len(text) > limit for text in texts) if fits and limit is not None else 0
        return {**_answer_fields(answer), "num_answers_shortened": num_shortened}

    async def _cancel(self, request_ids: set[str]) -> None:
        """Cancel every request still in flight; the tombstone also covers one not started yet."""
        if not request_ids:
            return
        results = await asyncio.gather(
            *(output.cancel(self.redis, self.keys, rid, ttl_s=self.settings.cancel_ttl_s) for rid in request_ids),
            return_exceptions=True,
        )
        failed = [result for result in results if isinstance(result, BaseException)]
        if failed:
            log_event(log, "job_cancel_failed", logging.WARNING, requests=len(failed), error=str(failed[0]))


def _answer_fields(answer: Answer) -> dict[str, Any]:
    return {
        "text": answer.text,
        "finish_reason": answer.finish_reason,
        "completion_tokens": answer.completion_tokens,
        "error": answer.error(),
    }


def aggregate(chunks: list[Chunk], answers: dict[int, Answer], combined: dict[str, Any] | None) -> dict[str, Any]:
    """The job's result: answers in chunk order, each with its lines and how it ended."""
    ordered = [answers[chunk.index] for chunk in chunks]
    return {
        "num_chunks": len(chunks),
        "num_failed": sum(not answer.ok for answer in ordered),
        "chunks": [
            {
                "index": chunk.index,
                "first_line": chunk.first_line,
                "last_line": chunk.last_line,
                **_answer_fields(answer),
            }
            for chunk, answer in zip(chunks, ordered, strict=True)
        ],
        "combined": combined,
        "usage": {
            "prompt_tokens": sum(answer.prompt_tokens for answer in ordered),
            "completion_tokens": sum(answer.completion_tokens for answer in ordered)
            + (combined["completion_tokens"] if combined else 0),
        },
    }


def redis_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis failing: a Redis error, or a task group's errors that all are."""
    if isinstance(exc, BaseExceptionGroup):
        return all(redis_failure(inner) for inner in exc.exceptions)
    return isinstance(exc, RedisError)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return _describe(exc.exceptions[0])
    message = getattr(exc, "message", None) or str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _ms_since(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
