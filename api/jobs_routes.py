"""Batch jobs: ``POST /v1/jobs`` submits a log-analysis job to arq, ``GET`` reports it, ``DELETE`` aborts it.

Statuses: ``queued`` (waiting for a jobs process), ``running``, ``complete``, ``failed``, ``aborted``.
arq's stored result decides the final status; before it exists the progress hash ``tc:job:{id}``
and arq's queue say where the job is. ``DELETE`` asks arq to abort and waits up to
``jobs_abort_wait_s``: 200 with the final status when the job stopped in time, else 202 with the
current one (a queued job is aborted when a jobs process picks it up).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from arq.constants import abort_jobs_ss
from arq.jobs import Job
from arq.jobs import JobStatus as ArqStatus
from fastapi import APIRouter, Depends, Request
from redis.exceptions import RedisError

from admission.request import ChatPrompt
from api.auth import api_key_of, check_auth, get_state
from api.openai_routes import TENANT_HEADER
from api.responses import OrjsonResponse
from api.schemas import JobRequest
from api.state import ApiState
from jobs.prompts import chunk_messages
from queues.jobs import (
    ARQ_START_WINDOW_S,
    JOB_FUNCTION,
    TERMINAL_STATUSES,
    JobProgress,
    JobSpec,
    JobStatus,
    JobStore,
    loads_job,
)
from queues.messages import DEFAULT_TENANT
from tailcut.errors import (
    InvalidRequestError,
    JobFailedError,
    JobNotFoundError,
    PermissionDeniedError,
    ServiceUnavailableError,
)

router = APIRouter(dependencies=[Depends(check_auth)])


@router.post("/v1/jobs", status_code=202)
async def create_job(body: JobRequest, request: Request) -> OrjsonResponse:
    state = get_state(request)
    state.drain.refuse_if_draining()
    settings = state.jobs_settings
    state.admitter.check_model(body.model)
    lines = body.log_lines()
    spec = JobSpec(
        lines=lines,
        instruction=body.instruction,
        chunk_lines=body.chunk_lines or settings.jobs_chunk_lines,
        max_tokens=body.max_tokens or settings.jobs_max_tokens,
        temperature=body.temperature,
        tenant=job_tenant(request, body.tenant),
        ignore_eos=body.ignore_eos,
        reduce=body.reduce,
    )
    num_chunks = len(spec.chunks())
    if num_chunks > settings.jobs_max_chunks:
        raise InvalidRequestError(
            f"the log makes {num_chunks} chunks of {spec.chunk_lines} lines; at most {settings.jobs_max_chunks} "
            "are accepted: raise `chunk_lines` or split the log into several jobs",
            param="chunk_lines",
        )
    await check_chunks_fit(state, spec)
    job_id = uuid.uuid4().hex
    try:
        await JobStore(state.redis, state.keys).create(
            job_id,
            num_chunks=num_chunks,
            total=spec.num_requests,
            ttl_s=int(ARQ_START_WINDOW_S + settings.jobs_timeout_s + settings.jobs_result_ttl_s),
            tenant=spec.tenant or DEFAULT_TENANT,
        )
        await state.arq.enqueue_job(JOB_FUNCTION, spec.to_payload(), _job_id=job_id)
    except RedisError as exc:
        raise ServiceUnavailableError(f"the job queue (Redis) does not answer: {exc}") from exc
    return OrjsonResponse(
        {"id": job_id, "object": "job", "status": "queued", "num_chunks": num_chunks}, status_code=202
    )


def job_tenant(request: Request, asked: str | None) -> str | None:
    """The job's tenant: its key's (TAILCUT_AUTH_REQUIRED; a job's requests run in the background tier,
    which the key must allow), else what the request says."""
    key = api_key_of(request)
    if key is None:
        return request.headers.get(TENANT_HEADER) or asked
    if "background" not in key.tiers:
        raise PermissionDeniedError("this API key may not use the background tier, where jobs run", param="tier")
    return key.tenant


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, request: Request) -> OrjsonResponse:
    return OrjsonResponse(await job_view(get_state(request), job_id, reader_of(request)))


@router.delete("/v1/jobs/{job_id}", responses={202: {"description": "Aborting: the job is still stopping."}})
async def abort_job(job_id: str, request: Request) -> OrjsonResponse:
    state = get_state(request)
    reader = reader_of(request)
    view = await job_view(state, job_id, reader)
    if view["status"] in TERMINAL_STATUSES:
        return OrjsonResponse(view)
    try:
        await JobStore(state.redis, state.keys).request_abort(job_id)
        await arq_job(state, job_id).abort(timeout=state.jobs_settings.jobs_abort_wait_s, poll_delay=0.05)
    except (TimeoutError, JobFailedError):
        pass  # still stopping (202 below), or it failed meanwhile: the view says which
    except RedisError as exc:
        raise ServiceUnavailableError(f"the job queue (Redis) does not answer: {exc}") from exc
    view = await job_view(state, job_id, reader)
    if view["status"] in ("complete", "failed"):
        # It ended on its own just before the abort: arq never ages out the abort mark it left.
        with contextlib.suppress(RedisError):
            await state.arq.zrem(abort_jobs_ss, job_id)
    return OrjsonResponse(view, status_code=200 if view["status"] in TERMINAL_STATUSES else 202)


async def check_chunks_fit(state: ApiState, spec: JobSpec) -> None:
    """Refuse a job with a chunk whose prompt plus answer exceeds the context (admission's own rule),
    naming the chunk and the fix."""
    chunks = spec.chunks()
    prompts = await asyncio.gather(
        *(
            state.admitter.prompt_ids(ChatPrompt(chunk_messages(spec.instruction, chunk, len(chunks))))
            for chunk in chunks
        )
    )
    for chunk, prompt in zip(chunks, prompts, strict=True):
        try:
            state.admitter.output_budget(len(prompt), spec.max_tokens)
        except InvalidRequestError as exc:
            fix = (
                "shorten that line or lower `max_tokens`"
                if spec.chunk_lines == 1
                else f"lower `chunk_lines` (now {spec.chunk_lines}) or `max_tokens` (now {spec.max_tokens})"
            )
            raise InvalidRequestError(
                f"chunk {chunk.index + 1} of {len(chunks)} (log lines {chunk.first_line}-{chunk.last_line}) needs "
                f"{len(prompt)} prompt tokens + {spec.max_tokens} for the answer = {len(prompt) + spec.max_tokens} "
                f"tokens, over this model's maximum context length of {state.model.max_model_len}; {fix}",
                param="chunk_lines",
                code=exc.code,
            ) from exc


def arq_job(state: ApiState, job_id: str) -> Job:
    return Job(job_id, state.arq, _queue_name=state.keys.arq_queue, _deserializer=loads_job)


def reader_of(request: Request) -> str | None:
    """Whose jobs the request may see: its key's tenant's (TAILCUT_AUTH_REQUIRED); None: any job (without
    keys the tenant is whatever a client says, so it proves nothing)."""
    key = api_key_of(request)
    return key.tenant if key is not None else None


async def job_view(state: ApiState, job_id: str, reader: str | None = None) -> dict[str, Any]:
    """The job as ``GET /v1/jobs/{id}`` shows it; 404 for an id this deployment does not know, or (with
    ``reader``) another tenant's job.

    A final status read from arq's result is written back to the progress hash (with the result's
    TTL), so a job that never ran (aborted while queued) still reads as aborted once arq's result
    has expired, and its record goes away with it.
    """
    store = JobStore(state.redis, state.keys)
    try:
        progress = await store.read(job_id)
        if progress is None or (reader is not None and progress.tenant != reader):
            raise JobNotFoundError(f"no job with id {job_id!r} (never submitted here, or expired)", param="id")
        job = arq_job(state, job_id)
        info = await job.result_info()
        arq_status = None if info is not None else await job.status()
        if arq_status == ArqStatus.complete:
            # arq stored the result between the two reads: read it, rather than show the job
            # complete with no result.
            info = await job.result_info()
    except RedisError as exc:
        raise ServiceUnavailableError(f"the job store (Redis) does not answer: {exc}") from exc
    status: JobStatus = progress.status
    result: Any = None
    message = progress.error
    if info is not None:
        if info.success:
            status, result = "complete", info.result
        elif isinstance(info.result, asyncio.CancelledError):
            status = "aborted"
        else:
            status, message = "failed", progress.error or str(info.result)
        if progress.status != status:
            with contextlib.suppress(RedisError):
                await store.finish(job_id, status, ttl_s=state.jobs_settings.jobs_result_ttl_s, error=message)
    elif arq_status == ArqStatus.in_progress:
        status = "running"
    elif arq_status in (ArqStatus.queued, ArqStatus.deferred):
        status = "queued"
    elif status not in TERMINAL_STATUSES:
        status, message = "failed", "arq no longer holds this job (it expired before a jobs process ran it)"
    return render(job_id, status, progress, result, describe_error(status, message))


def describe_error(status: JobStatus, message: str | None) -> dict[str, str] | None:
    if status == "aborted":
        return {"code": "aborted", "message": "the job was aborted"}
    if status == "failed":
        return {"code": "job_failed", "message": message or "the job failed"}
    return None


def render(
    job_id: str, status: JobStatus, progress: JobProgress, result: Any, error: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "id": job_id,
        "object": "job",
        "status": status,
        "created_at": progress.created_ms // 1000,
        "num_chunks": progress.num_chunks,
        "progress": {"done": progress.done, "failed": progress.failed, "total": progress.total},
        "result": result,
        "error": error,
    }
