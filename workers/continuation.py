"""Requests as the scheduler sees them, and continuations (a request resumed from its output so far)."""

from __future__ import annotations

from dataclasses import replace

from queues.messages import RequestMessage
from workers.scheduler import SchedRequest


def sched_request(message: RequestMessage) -> SchedRequest:
    generated = len(message.generated_token_ids)
    return SchedRequest(
        id=message.id,
        tier=message.tier,
        bucket=message.bucket,
        tenant=message.tenant,
        arrival_ms=message.enqueued_at_ms,
        deadline_ms=message.deadline_ms,
        prompt_tokens=len(message.prompt_token_ids) + generated,
        remaining_tokens=message.sampling.max_tokens - generated,
    )


def continuation(message: RequestMessage, generated: list[int], *, next_seq: int) -> RequestMessage:
    """The message that resumes ``message`` after ``generated`` tokens and ``next_seq - 1`` events.

    The original arrival time travels on, so a continuation keeps its place in the tier order, and
    the client sees one stream: positions continue at ``next_seq``, the prompt grows by the tokens it
    already has, and ``max_tokens`` still counts from the original request.
    """
    return replace(
        message,
        generated_token_ids=list(generated),
        next_seq=next_seq,
        slice_index=message.slice_index + 1,
    )
