"""Message schemas that travel through Redis, serialized with orjson.

A ``RequestMessage`` is one intake stream entry (field ``d``); an ``OutputEvent`` is one entry of a
request's output stream and one element of a reply-channel batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from queues.keys import Bucket, Tier

EventType = Literal["chunk", "degraded", "final", "error"]
TERMINAL_EVENTS: frozenset[str] = frozenset({"final", "error"})


@dataclass(slots=True, kw_only=True)
class SamplingOptions:
    """Engine-neutral sampling parameters (the OpenAI fields plus the vLLM extensions clients send),
    all but the output length."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@dataclass(slots=True, kw_only=True)
class SamplingSpec(SamplingOptions):
    """Sampling parameters with the output length settled at admission."""

    max_tokens: int

    @classmethod
    def of(cls, options: SamplingOptions, *, max_tokens: int) -> SamplingSpec:
        values = {name: getattr(options, name) for name in _OPTION_NAMES}
        return cls(**values, max_tokens=max_tokens)


# Once, not per request (``dataclasses.fields`` builds its tuple at every call).
_OPTION_NAMES: tuple[str, ...] = tuple(item.name for item in dataclasses.fields(SamplingOptions))


# The tenant of a request that names none (auth off, no ``user`` or ``X-Tailcut-Tenant``).
DEFAULT_TENANT = "default"


@dataclass(slots=True)
class RequestMessage:
    """One request as the API enqueued it; a continuation carries the tokens generated so far."""

    id: str
    tenant: str
    tier: Tier
    bucket: Bucket
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    predicted_output_tokens: int
    enqueued_at_ms: int
    deadline_ms: int
    reply_to: str
    attempt: int = 0
    idempotency_key: str | None = None
    # Continuations (preempted or sliced requests) resume from here.
    slice_index: int = 0
    generated_token_ids: list[int] = field(default_factory=list)
    next_seq: int = 1
    # Epoch ms of the continuation's last output (0: none yet): how long it has waited to resume.
    last_output_ms: int = 0
    # Text of generated tokens not sent yet: the end of the last engine call, held back because it may
    # begin a stop string that the next call completes (``workers.lifecycle``).
    held_text: str = ""

    def dumps(self) -> bytes:
        return orjson.dumps(self)

    def cost_tokens(self) -> int:
        """Tokens the request still costs the engine: its context to prefill (prompt and what was
        generated so far) and the rest of its predicted output."""
        generated = len(self.generated_token_ids)
        return len(self.prompt_token_ids) + generated + max(0, self.predicted_output_tokens - generated)

    @classmethod
    def loads(cls, data: bytes) -> RequestMessage:
        raw: dict[str, Any] = orjson.loads(data)
        raw["sampling"] = SamplingSpec(**raw["sampling"])
        return cls(**raw)


@dataclass(slots=True)
class OutputEvent:
    """One sequence-numbered event of a request's output; ``seq`` starts at 1 and has no holes."""

    rid: str
    seq: int
    type: EventType
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    # On a ``degraded`` event and on the final event after it: what the client gets instead of the
    # full reply and why, e.g. {"degraded": "summary", "reason": "heartbeat", "gap_ms": 734}.
    degraded: dict[str, str | int] | None = None
    # Worker-side only (clients never see it): the reply's text held back after this chunk, so a worker
    # that takes the request over resumes with it (``RequestMessage.held_text``).
    held: str = ""

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def dumps(self) -> bytes:
        """The event's wire form (an output stream entry, an element of a reply-channel batch): the
        fields that differ from their defaults, so a chunk carries only its position, text and tokens."""
        if self.type == "chunk":
            chunk = {"rid": self.rid, "seq": self.seq, "type": "chunk", "text": self.text, "token_ids": self.token_ids}
            if self.held:
                chunk["held"] = self.held
            return orjson.dumps(chunk)
        return orjson.dumps(
            {name: value for name, default in _EVENT_DEFAULTS if (value := getattr(self, name)) != default}
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> OutputEvent:
        return cls(**raw)


# (field, default) of every ``OutputEvent`` field; the required ones never equal the sentinel.
_EVENT_DEFAULTS: tuple[tuple[str, Any], ...] = tuple(
    (item.name, item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default)
    for item in dataclasses.fields(OutputEvent)
)


def lost_event(request_id: str, seq: int) -> OutputEvent:
    """The terminal event a reader gives its client when the request is gone from Redis: nothing will
    ever write its end (Redis restarted without persistence, or the request's records expired)."""
    return OutputEvent(
        rid=request_id,
        seq=seq,
        type="error",
        error_code="request_lost",
        error_message="the request is no longer in Redis (it restarted without persistence, or the "
        "request expired) and will not finish; send it again",
    )


def dumps_events(events: list[OutputEvent]) -> bytes:
    return b"[" + b",".join(event.dumps() for event in events) + b"]"


def loads_events(data: bytes) -> list[OutputEvent]:
    return [OutputEvent.from_dict(raw) for raw in orjson.loads(data)]
