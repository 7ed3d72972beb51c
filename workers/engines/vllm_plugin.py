"""A vLLM general plugin: lets the worker change the engine's per-step token budget and its prefill
chunk at runtime, and makes the processes vLLM starts die with the one that started them.

vLLM loads ``vllm.general_plugins`` entry points in every process it starts, the engine-core process
included; ``register`` adds utility methods to ``EngineCore`` there, which the worker calls with
``engine_core.call_utility_async(name, ...)``. No public vLLM API changes the budget of a running
``AsyncLLM`` (ENGINE-NOTES.md): this relies on the scheduler reading
``scheduler_config.max_num_batched_tokens`` and ``long_prefill_token_threshold`` every step and on
``max_num_scheduled_tokens``, all internal to vLLM 0.32. ``VllmEngine`` checks at start that the
methods answer and otherwise falls back to admission-level budgeting with one log line.
"""

from __future__ import annotations

from collections import deque
from typing import Any

SET_BUDGET = "tailcut_set_token_budget"
SET_PREFILL_CHUNK = "tailcut_set_prefill_chunk"
PREFILL_CHUNK = "tailcut_prefill_chunk"
STEP_TOKENS = "tailcut_step_tokens"
# How many recent engine steps keep their scheduled-token count (for tests and diagnostics).
STEPS_KEPT = 256


def _set_token_budget(core: Any, num_tokens: int) -> int:
    """Set the step budget to ``num_tokens``, never above the value the engine started with (its
    buffers are sized for that); returns the budget in force."""
    scheduler = core.scheduler
    if not hasattr(core, "_tailcut_start_budget"):
        core._tailcut_start_budget = int(scheduler.scheduler_config.max_num_batched_tokens)
        _record_steps(core)
    budget: int = max(1, min(int(num_tokens), int(core._tailcut_start_budget)))
    scheduler.max_num_scheduled_tokens = budget
    scheduler.scheduler_config.max_num_batched_tokens = budget
    return budget


def _set_prefill_chunk(core: Any, num_tokens: int) -> int:
    """Set ``long_prefill_token_threshold`` (the most prompt tokens one request computes per step;
    0: no cap), which vLLM's scheduler reads at every step; returns the value in force."""
    chunk = max(0, int(num_tokens))
    core.scheduler.scheduler_config.long_prefill_token_threshold = chunk
    return chunk


def _prefill_chunk(core: Any) -> int:
    """The ``long_prefill_token_threshold`` vLLM's scheduler reads at its next step."""
    return int(core.scheduler.scheduler_config.long_prefill_token_threshold)


def _record_steps(core: Any) -> None:
    scheduler = core.scheduler
    original = scheduler.schedule
    core._tailcut_steps = deque(maxlen=STEPS_KEPT)

    def schedule(*args: Any, **kwargs: Any) -> Any:
        output = original(*args, **kwargs)
        if output.total_num_scheduled_tokens:
            core._tailcut_steps.append(int(output.total_num_scheduled_tokens))
        return output

    scheduler.schedule = schedule


def _step_tokens(core: Any) -> list[int]:
    """Scheduled tokens of the recent steps (oldest first), then forget them."""
    steps: deque[int] = getattr(core, "_tailcut_steps", deque())
    recorded = list(steps)
    steps.clear()
    return recorded


def _as_a_child_of_the_worker() -> None:
    """In a process vLLM started (its engine core, its model workers), die with the process that
    started it: a worker SIGKILLed without a word must not leave its engine running (holding the GPU's
    memory, so that the worker restarted in its place cannot start). The worker process itself, which
    loads plugins too, is left alone: it may outlive its own parent (a shell, ``nohup``). These processes
    also exit without the interpreter's last collection (``tailcut.cli`` does the same for the worker
    process), or the engine takes 5 s and a SIGKILL to stop."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        from tailcut.processes import die_with_parent, exit_without_a_last_collection

        die_with_parent(parent.pid)
        exit_without_a_last_collection()


def register() -> None:
    from vllm.v1.engine.core import EngineCore

    _as_a_child_of_the_worker()

    setattr(EngineCore, SET_BUDGET, _set_token_budget)
    setattr(EngineCore, SET_PREFILL_CHUNK, _set_prefill_chunk)
    setattr(EngineCore, PREFILL_CHUNK, _prefill_chunk)
    setattr(EngineCore, STEP_TOKENS, _step_tokens)
