"""The worker's engine-call sink (``workers.worker.CallOutput``) on the zero-cost engine: each request's
output is taken in the engine's own output loop, one step's deltas for every running request in turn,
and the call's task wakes once, at its end; nothing is taken after that task is told to stop."""

from __future__ import annotations

import asyncio

from queues.messages import SamplingSpec
from workers.engines.base import EngineDelta
from workers.engines.filler import FillerToken
from workers.engines.null import NullEngine
from workers.worker import CallOutput

FILLER = FillerToken(token_id=7, text=" x")


def spec(max_tokens: int) -> SamplingSpec:
    return SamplingSpec(max_tokens=max_tokens, temperature=0.0)


async def run_call(
    engine: NullEngine, request_id: str, max_tokens: int, taken: list[tuple[str, str | None]]
) -> str | None:
    """One call as the worker runs it: ``taken`` gets (request, the task that took the delta)."""

    def take(delta: EngineDelta) -> None:
        task = asyncio.current_task()
        taken.append((request_id, task.get_name() if task is not None else None))

    output = CallOutput(take)
    await engine.submit(request_id, [1, 2], spec(max_tokens), priority=0, cache_salt=None, sink=output)
    try:
        return await output.finished
    finally:
        if output.close():
            await engine.abort(request_id)


async def test_every_requests_output_is_taken_in_the_engines_loop_not_in_a_task_of_its_own() -> None:
    engine = NullEngine(max_model_len=512, filler=FILLER, step_ms=1)
    taken: list[tuple[str, str | None]] = []
    calls = [asyncio.create_task(run_call(engine, f"r{index}", 5, taken), name=f"call-r{index}") for index in range(50)]
    assert await asyncio.gather(*calls) == ["length"] * 50
    assert len(taken) == 50 * 5
    assert {task for _, task in taken} == {"null-engine"}
    assert engine.num_steps == 5 and engine.num_unfinished() == 0
    await engine.shutdown()


async def test_nothing_is_taken_once_the_calls_task_is_cancelled_and_the_engine_stops_the_request() -> None:
    """A preemption decided while the engine hands out a step (here by the request before it in the
    step): the cancelled request's delta later in the same step is not taken."""
    engine = NullEngine(max_model_len=100_000, filler=FILLER, step_ms=1)
    taken: list[str] = []
    victim: asyncio.Task[str | None] | None = None

    async def call(request_id: str, max_tokens: int) -> str | None:
        def take(delta: EngineDelta) -> None:
            taken.append(request_id)
            if request_id == "preempter" and taken.count("preempter") == 3:
                assert victim is not None
                victim.cancel()

        output = CallOutput(take)
        await engine.submit(request_id, [1], spec(max_tokens), priority=0, cache_salt=None, sink=output)
        try:
            return await output.finished
        finally:
            if output.close():
                await engine.abort(request_id)

    preempter = asyncio.create_task(call("preempter", 5))  # first in each step's order
    victim = asyncio.create_task(call("victim", 10_000))
    assert await preempter == "length"
    try:
        await victim
    except asyncio.CancelledError:
        pass
    assert victim.cancelled()
    assert taken.count("victim") == 2  # steps 1 and 2; step 3's came after the cancel
    assert engine.num_unfinished() == 0  # aborted by the call's end
    await engine.shutdown()


async def test_a_failing_take_ends_the_call_with_its_error_and_the_engine_stops_the_request() -> None:
    engine = NullEngine(max_model_len=100_000, filler=FILLER, step_ms=1)

    def take(delta: EngineDelta) -> None:
        raise ValueError("a bug in the worker's handling")

    async def call() -> None:
        output = CallOutput(take)
        await engine.submit("bad", [1], spec(10_000), priority=0, cache_salt=None, sink=output)
        try:
            await output.finished
        finally:
            assert output.close()  # the engine did not end the request
            await engine.abort("bad")

    try:
        await call()
    except ValueError as exc:
        assert "a bug" in str(exc)
    else:
        raise AssertionError("the call ended without the take's error")
    assert engine.num_unfinished() == 0  # the engine loop survived it, and stopped the request
    assert ["length"] == [await run_call(engine, "next", 2, [])]
    await engine.shutdown()


async def test_a_dead_engine_ends_the_call_with_its_error() -> None:
    engine = NullEngine(max_model_len=100_000, filler=FILLER, step_ms=1)
    output = CallOutput(lambda delta: None)
    await engine.submit("r", [1], spec(10_000), priority=0, cache_salt=None, sink=output)
    await asyncio.sleep(0.005)
    await engine.shutdown()
    try:
        await output.finished
    except Exception as exc:
        assert type(exc).__name__ == "EngineDeadError"
    else:
        raise AssertionError("the call did not see the engine die")
    assert not output.close()  # ended by the engine: nothing to abort
