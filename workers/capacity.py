"""How the driver of a policy (the worker, the simulator) sees its engine: capacity left, the step time,
and when the engine's step budget should follow the scheduler's (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from queues.keys import Bucket, Tier
from workers.scheduling import EngineView, SchedulingPolicy

# Weight of the newest step time in the smoothed one the scheduler sees (its slack rule).
STEP_SMOOTHING = 0.2
# The engine's step budget moves on a grid of this many tokens: the room rule follows the running
# count, and each change is a call into vLLM's engine process.
BUDGET_APPLY_STEP = 64


def engine_view(
    scheduler: SchedulingPolicy,
    *,
    max_running: int,
    kv_capacity_tokens: int,
    backlog: Mapping[tuple[Tier, Bucket], int],
    step_ms: float,
    admit_background: bool = True,
) -> EngineView:
    """Slots and KV as the scheduler sees them: free KV is the capacity minus every running request's
    reservation (``SchedRequest.reserved_kv_tokens``, per ``config.kv_reservation``). A request being
    preempted has left ``running`` already (its abort is in flight), so it is not preempted a second
    time on the next round.

    A policy that does not admit by KV (``SchedulingPolicy.admits_by_kv``: fifo, vllm-priority) is
    not charged its reservations: its view shows the whole capacity free. It never reads the figure,
    and summing over everything a plain server has handed its engine would cost each round time in
    proportion to that backlog (the simulator's saturation runs hand it thousands)."""
    running = scheduler.running
    config = scheduler.config
    kv_tokens = sum(request.reserved_kv_tokens(config) for request in running.values()) if scheduler.admits_by_kv else 0
    return EngineView(
        free_slots=max_running - len(running),
        free_kv_tokens=kv_capacity_tokens - kv_tokens,
        backlog=dict(backlog),
        step_ms=step_ms,
        admit_background=admit_background,
    )


class StepTimer:
    """The engine step time, smoothed: the worker observes the gap between a request's deltas (one
    per engine step), the simulator each step's duration."""

    def __init__(self, initial_ms: float = 20.0) -> None:
        self.value_ms = initial_ms

    def observe(self, step_ms: float) -> None:
        self.value_ms += STEP_SMOOTHING * (step_ms - self.value_ms)


class BudgetFollower:
    """Decides when the engine's per-step token budget follows the scheduler's: at once, rounded up
    to the ``BUDGET_APPLY_STEP`` grid, when the scheduler's is above the engine's (what it admitted
    must fit the step), and when it fell a whole grid step below it; not for smaller moves down."""

    def __init__(self, applied: int | None) -> None:
        self.applied = applied  # the value in force; None: unknown

    def update(self, budget: int | None) -> int | None:
        """The budget to apply to the engine now (counted as applied), or None to leave it."""
        if budget is None:
            return None
        if self.applied is not None and self.applied - BUDGET_APPLY_STEP < budget <= self.applied:
            return None
        self.applied = -(-budget // BUDGET_APPLY_STEP) * BUDGET_APPLY_STEP
        return self.applied


class ChunkFollower:
    """Decides when the engine's prefill chunk (vLLM's ``long_prefill_token_threshold``) follows the
    scheduler's: at every change (the scheduler moves it rarely). A driver starts it with ``None``,
    so the first chunk asked for is applied, and the scheduler told (``prefill_chunk_applied``),
    even one equal to the engine's own."""

    def __init__(self, applied: int | None) -> None:
        self.applied = applied  # the value in force; None: unknown

    def update(self, chunk: int | None) -> int | None:
        """The chunk to apply to the engine now (counted as applied), or None to leave it."""
        if chunk is None or chunk == self.applied:
            return None
        self.applied = chunk
        return chunk
