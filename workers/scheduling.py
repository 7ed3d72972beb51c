"""What every scheduling policy shares: the scheduler's view of a request and of the engine, its
decision, its configuration, and the interface the worker (and the simulator) drive (pure).

A policy is an object (``workers.policies.make_scheduler``): ``fifo`` and ``vllm-priority`` in
``workers.policies``, ``tailcut`` in ``workers.scheduler``. The driver feeds it requests and an
``EngineView`` with the current time and carries out its ``Decision``; no policy reads Redis, an
engine or a clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from queues.keys import Bucket, Tier
from queues.messages import RequestMessage
from workers.budget import BudgetConfig
from workers.retention import KeepAliveConfig

PolicyName = Literal["tailcut", "fifo", "vllm-priority"]
# What the scheduler counts of a request's output in the engine's KV cache (``SchedRequest.reserved_kv_tokens``).
KvReservation = Literal["none", "max", "predicted"]

TIER_RANK: dict[Tier, int] = {"realtime": 0, "normal": 1, "background": 2}
BUCKET_RANK: dict[Bucket, int] = {"short": 0, "medium": 1, "long": 2}


@dataclass(slots=True)
class SchedRequest:
    """A request as the scheduler sees it; a continuation's prompt includes its earlier output."""

    id: str
    tier: Tier
    bucket: Bucket
    tenant: str
    arrival_ms: int
    deadline_ms: int
    prompt_tokens: int
    remaining_tokens: int
    # The output-length prediction (``admission.predictor``) minus what was generated since: below 1
    # once the request outgrew it. None: no prediction (reserved as under ``max``).
    predicted_remaining_tokens: int | None = None
    # A continuation (a yielded or preempted request coming back): its prompt is not a client's.
    continuation: bool = False

    @classmethod
    def of(cls, message: RequestMessage) -> SchedRequest:
        generated = len(message.generated_token_ids)
        return cls(
            id=message.id,
            tier=message.tier,
            bucket=message.bucket,
            tenant=message.tenant,
            arrival_ms=message.enqueued_at_ms,
            deadline_ms=message.deadline_ms,
            prompt_tokens=len(message.prompt_token_ids) + generated,
            remaining_tokens=message.sampling.max_tokens - generated,
            predicted_remaining_tokens=message.predicted_output_tokens - generated,
            continuation=generated > 0,
        )

    def reserved_kv_tokens(self, config: SchedulerConfig) -> int:
        """KV the scheduler counts for this request's next engine call, in token slots of whole blocks:
        the prompt (a continuation's includes its output so far) plus the output the call is expected
        to write, per ``config.kv_reservation``:

        - ``none``: nothing beyond the prompt (what vLLM does by itself: blocks as decode proceeds);
        - ``max``: the rest of ``max_tokens``, at most one slice;
        - ``predicted``: the rest of the predicted output, at least one KV block once the request
          outgrew its prediction, never more than ``max`` would reserve (a request without a
          prediction reserves as under ``max``).

        Rounded up to whole ``config.kv_block_tokens`` blocks, as the engine allocates them. This is
        the one definition of a request's KV: admission, the engine view, yields and preemption all
        count it. It covers KV only: a running request's per-step token budget is one decode token
        whatever its reservation, and its prompt's prefill chunk is counted apart (``TailcutPolicy``).
        """
        # Written as one method, no helpers: the engine view runs it over every running request, every round.
        mode = config.kv_reservation
        if mode == "none":
            output = 0
        else:
            output = max(0, min(self.remaining_tokens, config.slice_tokens))
            predicted = self.predicted_remaining_tokens
            if mode == "predicted" and predicted is not None:
                # Outgrown: it goes on all the same, so its next block is still reserved.
                output = min(output, predicted if predicted > 0 else config.kv_block_tokens)
        block = config.kv_block_tokens
        return -(-(self.prompt_tokens + output) // block) * block

    def reserved_output_tokens(self, config: SchedulerConfig) -> int:
        """Output tokens the reservation holds room for beyond the prompt (its last partial block
        included): what ``workers.reservation.ReservationRecord`` compares a call's output against."""
        return self.reserved_kv_tokens(config) - self.prompt_tokens


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: PolicyName = "tailcut"
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    max_cut_ins: int = 3
    slice_tokens: int = 256
    # How a request's expected output counts in the KV the scheduler checks before admitting it and
    # before yielding or preempting for it (``SchedRequest.reserved_kv_tokens``).
    kv_reservation: KvReservation = "predicted"
    # The engine's KV block size: reservations are counted in whole blocks, as the engine allocates.
    kv_block_tokens: int = 16
    # Most prompt tokens the engine computes per request and step (vLLM's
    # ``long_prefill_token_threshold``; 0: a whole prompt may fill a step). Admitted prompts still
    # being prefilled take this much of every round's budget until their first token. With
    # ``adaptive``, tailcut asks for more (``Decision.prefill_chunk_tokens``), never less.
    prefill_chunk_tokens: int = 256
    # Tokens of every round's budget that only realtime prompts may use: running requests go first
    # in an engine step, so without a reserve a realtime prompt waits for lower-tier prefills. With
    # ``adaptive``, tailcut raises it (never lowers it) to fit the realtime prompts it sees.
    realtime_reserve_tokens: int = 256
    # Size the prefill chunk, the realtime reserve, the normal tier's room and the lower tiers' room
    # from the traffic seen (``workers.scheduler`` "Adaptive sizes"); prompt sizes are this quantile
    # of each tier's last ``prompt_window`` prompts (``workers.budget.PromptLengths``).
    adaptive: bool = True
    prompt_quantile: float = 0.99
    prompt_window: int = 512
    # The lower tiers' arrival rate and the realtime requests in flight are averaged over this long;
    # the lower tiers' room covers their backlog over ``backlog_drain_ms``, counting at most
    # ``backlog_max_requests`` waiting requests of a tier: a longer queue (background may wait far
    # longer than that: ``admission.shedding.ShedLimits``) waits for room rather than making it, so the
    # steps the realtime replies decode through do not grow with it.
    traffic_window_ms: int = 5_000
    backlog_drain_ms: int = 20_000
    backlog_max_requests: int = 64
    # Background waits while the realtime requests in flight exceed their recent average by this
    # share: each step they all wait on is a step of their latency; it catches up in the lulls.
    background_gate_margin: float = 0.1
    # ... unless this many background requests wait (0: never wait so), so its queue stays bounded.
    # Below the background tier's shedding bound (192), so what the gate and the slow-step rule hold
    # back waits instead of being refused.
    background_gate_max_waiting: int = 128
    # While the steps of about a reply's life run more than this share above the steps of the last
    # half minute, the lower tiers' prefill room is ``slow_step_room_chunks`` chunks at most and
    # background waits: the realtime replies decoding through a stretch of large steps pay every one of
    # them, and what the stretch holds back goes through once the steps are back. 0: off. At 0.07 the
    # realtime tail on the shipped workloads and seeds is 1.04-1.10x the floor (with the gate's bound
    # at 32 and background refused from 64: 1.04-1.11x, and 1.04-1.13x without the rule), background
    # at 90% on seed-mix 0.96-0.97x fifo's (0.98x without); at 0.05 it was 0.94-0.96x (BENCHMARKS.md
    # "The steps of a reply's life", "Background that waits instead of being refused").
    slow_step_margin: float = 0.07
    slow_step_room_chunks: int = 2
    # Overload: from this many background requests waiting (here and in the intake streams; below the
    # tier's shedding bound of 192) until half as many do, the worker serves less than the lower tiers
    # send, so their room no longer follows their demand: it is the budget rule's, taken in the
    # configured chunk (a longer realtime prompt is split), with no room held for the normal tier, no
    # gate and no slow-step rule — steps of one size, evenly filled, which the realtime replies decoding
    # through them need most when the engine never idles. 0: off, the default: at 176 it raised
    # background at 100% on three shipped workloads, but a burst at 90% on one trace set it off and the
    # realtime tail there went over its line (BENCHMARKS.md "Past what the worker serves").
    overload_background_waiting: int = 0
    # "Usual" is the step time averaged over this long of the scheduler's clock.
    slow_step_window_ms: int = 30_000
    # A normal prompt that waits for prefill room while background prompts are being prefilled takes
    # their room: the newest of them are preempted (what they computed stays in the engine's prefix
    # cache) and wait again, so a document arriving behind a log's 2,048-token prompt does not wait out
    # its every chunk. Off: the room it frees goes to background as well, and at 120% of fifo's
    # capacity on seed-mix the realtime tier paid for it (BENCHMARKS.md "A normal prompt that takes a
    # background prompt's room").
    normal_takes_background_prefill: bool = False
    # A realtime prompt admitted into a step that the prompts already in prefill fill (the engine runs
    # them first, and would split it) takes the room of the newest background ones the same way. Off:
    # its first token came 4 ms sooner at the P99 on a held-back-like mix, for 3% of background at 100%
    # (BENCHMARKS.md, the same section).
    realtime_takes_background_prefill: bool = False
    fair_quantum_tokens: int = 512
    fair_min_weight: float = 0.25
    fair_max_weight: float = 8.0
    # Weight of the newest queue wait in a tenant's moving average (its "recent latency").
    rtt_smoothing: float = 0.2
    # Prefix keep-alive of finished chat turns (``workers.retention``; the ``tailcut`` policy only).
    keep_alive: KeepAliveConfig = field(default_factory=KeepAliveConfig)

    def __post_init__(self) -> None:
        if self.kv_block_tokens < 1:
            raise ValueError(f"kv_block_tokens must be at least 1 (the engine's KV block size): {self.kv_block_tokens}")
        if self.background_gate_margin < 0 or self.background_gate_max_waiting < 0:
            raise ValueError(
                "background_gate_margin and background_gate_max_waiting must not be negative (0 waiting: no gate): "
                f"{self.background_gate_margin}, {self.background_gate_max_waiting}"
            )
        if self.slow_step_margin < 0 or self.slow_step_room_chunks < 1 or self.slow_step_window_ms < 1:
            raise ValueError(
                "slow_step_margin must not be negative (0: off), slow_step_room_chunks and slow_step_window_ms must "
                f"be at least 1: {self.slow_step_margin}, {self.slow_step_room_chunks}, {self.slow_step_window_ms}"
            )
        if self.overload_background_waiting < 0:
            raise ValueError(
                f"overload_background_waiting must not be negative (0: off): {self.overload_background_waiting}"
            )
        if self.traffic_window_ms < 1 or self.backlog_drain_ms < 1 or self.backlog_max_requests < 1:
            raise ValueError(
                "traffic_window_ms, backlog_drain_ms and backlog_max_requests must be at least 1: "
                f"{self.traffic_window_ms}, {self.backlog_drain_ms}, {self.backlog_max_requests}"
            )
        if not 0 < self.prompt_quantile <= 1 or self.prompt_window < 1:
            raise ValueError(
                f"prompt_quantile must be in (0, 1] and prompt_window at least 1: {self.prompt_quantile}, "
                f"{self.prompt_window}"
            )


@dataclass(frozen=True, slots=True)
class EngineView:
    """The engine's capacity right now, and what waits in Redis that this worker has not read."""

    free_slots: int
    free_kv_tokens: int
    backlog: dict[tuple[Tier, Bucket], int] = field(default_factory=dict)
    step_ms: float = 20.0
    # False while the realtime breaker is open (degrade mode): no background is admitted.
    admit_background: bool = True

    def backlog_of(self, *, tiers: tuple[Tier, ...] = (), buckets: tuple[Bucket, ...] = ()) -> int:
        return sum(
            count
            for (tier, bucket), count in self.backlog.items()
            if (not tiers or tier in tiers) and (not buckets or bucket in buckets)
        )


@dataclass(slots=True)
class Decision:
    admit: list[SchedRequest] = field(default_factory=list)
    preempt: list[SchedRequest] = field(default_factory=list)
    # Per-step token budget to apply to the engine; None: leave the engine's own.
    token_budget: int | None = None
    # Most prompt tokens per request and step to apply to the engine (its
    # ``long_prefill_token_threshold``); None: leave the engine's own.
    prefill_chunk_tokens: int | None = None


class SchedulingPolicy(Protocol):
    """What the worker and the simulator drive. Between rounds (``schedule``): ``add`` (a request
    arrived), ``prefilled`` (its first token), ``advance`` and ``at_slice_boundary`` (a slice ended:
    continue or yield?), ``finish`` / ``remove`` (it left)."""

    config: SchedulerConfig

    @property
    def running(self) -> dict[str, SchedRequest]: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def steers_token_budget(self) -> bool:
        """Whether decisions carry a token budget for the engine's steps."""
        ...

    @property
    def admits_by_kv(self) -> bool:
        """Whether ``schedule`` and ``at_slice_boundary`` read ``EngineView.free_kv_tokens`` (a policy
        that admits by free slots alone leaves KV to the engine's own allocator)."""
        ...

    def waiting(self) -> Iterator[SchedRequest]: ...

    def add(self, request: SchedRequest) -> None: ...

    def remove(self, request_id: str) -> SchedRequest | None:
        """Forget a waiting or running request (cancelled, expired, preempted by hand)."""
        ...

    def finish(self, request_id: str, request: SchedRequest | None = None) -> None:
        """The request left the engine; with ``request``, only if that is the one running under this
        id (a continuation of it may already be running again)."""
        ...

    def prefilled(self, request_id: str) -> None: ...

    def prompt_cached(self, request_id: str, num_cached_tokens: int) -> None:
        """The engine served ``num_cached_tokens`` of the running request's prompt from its prefix cache
        (vLLM reports it with the first output; the simulator's step result has it)."""
        ...

    def prefill_chunk_applied(self, num_tokens: int) -> None:
        """The driver set the engine's prefill chunk to ``num_tokens`` (``Decision.prefill_chunk_tokens``)."""
        ...

    def advance(self, request_id: str, num_generated: int) -> None: ...

    def schedule(self, view: EngineView, now_ms: int) -> Decision: ...

    def slice_limit(self, request: SchedRequest) -> int:
        """Most tokens the next engine call of ``request`` may produce."""
        ...

    def engine_priority(self, request: SchedRequest) -> int: ...

    def summary_priority(self, request: SchedRequest) -> int:
        """Engine priority of a degraded request's summary: ahead of its tier, behind more urgent ones."""
        ...

    @property
    def degrades(self) -> bool:
        """Whether late requests finish with a summary (``workers.degrade``) under this policy."""
        ...

    def at_slice_boundary(self, request_id: str, view: EngineView) -> bool:
        """``True``: the request yields (the caller re-queues it as a continuation); ``False``: go on."""
        ...

    def prefetch_room(self, tier: Tier, prefetch: int) -> int:
        """How many more requests of ``tier`` the driver may read ahead into the local queue."""
        ...

    def admit_now(self, request: SchedRequest) -> None:
        """Count ``request`` (taken out of the queue with ``remove``) as running without a round: a
        degraded continuation's summary, which must not wait for one."""
        ...


class RequestHeap:
    """Requests ordered by a key; stable for equal keys."""

    def __init__(self) -> None:
        self._items: list[tuple[tuple[int, ...], int, SchedRequest]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[SchedRequest]:
        return (item for _key, _n, item in self._items)

    def push(self, key: tuple[int, ...], request: SchedRequest) -> None:
        heapq.heappush(self._items, (key, next(self._counter), request))

    def peek(self) -> SchedRequest | None:
        return self._items[0][2] if self._items else None

    def pop(self) -> SchedRequest:
        return heapq.heappop(self._items)[2]

    def remove(self, request_id: str) -> SchedRequest | None:
        for index, (_key, _n, request) in enumerate(self._items):
            if request.id == request_id:
                self._items.pop(index)
                heapq.heapify(self._items)
                return request
        return None


class RunningTable:
    """The requests a policy has in the engine; the part every policy shares."""

    def __init__(self) -> None:
        self._running: dict[str, SchedRequest] = {}

    @property
    def running(self) -> dict[str, SchedRequest]:
        return self._running

    def finish(self, request_id: str, request: SchedRequest | None = None) -> None:
        if request is None or self._running.get(request_id) is request:
            self._running.pop(request_id, None)
            self._forget(request_id)

    def advance(self, request_id: str, num_generated: int) -> None:
        """A slice produced ``num_generated`` tokens: they become part of the prompt of the next one."""
        request = self._running.get(request_id)
        if request is not None:
            request.prompt_tokens += num_generated
            request.remaining_tokens -= num_generated
            if request.predicted_remaining_tokens is not None:
                request.predicted_remaining_tokens -= num_generated

    def admit_now(self, request: SchedRequest) -> None:
        self._running[request.id] = request

    def prefilled(self, request_id: str) -> None:
        """The engine produced the request's first token (only ``tailcut`` counts prefills)."""

    def prompt_cached(self, request_id: str, num_cached_tokens: int) -> None:
        """The engine's prefix cache served part of the prompt (only ``tailcut`` learns from it)."""

    def prefill_chunk_applied(self, num_tokens: int) -> None:
        """The engine's prefill chunk changed (only ``tailcut`` asks for that)."""

    def _forget(self, request_id: str) -> None:
        """Drop per-request state beyond the running table (a hook for subclasses)."""
