"""What the drivers apply to the engine from the scheduler's decisions: the step budget and the
prefill chunk (pure: the simulated engine and a stand-in for vLLM's engine core)."""

from __future__ import annotations

from types import SimpleNamespace

from workers.capacity import BUDGET_APPLY_STEP, BudgetFollower, ChunkFollower
from workers.engines.costmodel import PROFILES
from workers.engines.sim import SimEngine
from workers.engines.vllm_plugin import _set_prefill_chunk


def test_the_engine_budget_follows_up_at_once_and_down_by_a_whole_grid_step() -> None:
    follower = BudgetFollower(1024)
    assert follower.update(None) is None
    assert follower.update(1000) is None  # a small move down: left
    assert follower.update(1025) == 1024 + BUDGET_APPLY_STEP  # any move up: applied, on the grid
    assert follower.update(1050) is None  # within what is in force (1088)
    assert follower.update(1030) is None
    assert follower.update(1024) == 1024  # a whole step below it: followed
    assert BudgetFollower(None).update(700) == 704


def test_the_engine_chunk_follows_every_change() -> None:
    follower = ChunkFollower(256)
    assert follower.update(None) is None
    assert follower.update(256) is None
    assert follower.update(608) == 608
    assert follower.update(608) is None
    assert follower.update(512) == 512


def test_the_simulated_engine_chunks_prefill_at_the_chunk_set() -> None:
    engine = SimEngine(PROFILES["h100-llama3-8b"], kv_capacity_tokens=100_000, long_prefill_token_threshold=256)
    engine.add("a", 600, 4)
    engine.add("b", 600, 4)
    assert engine.step().scheduled_tokens == {"a": 256, "b": 256}
    assert engine.set_prefill_chunk(600) == 600
    assert engine.step().scheduled_tokens == {"a": 344, "b": 344}  # the rest of each prompt at once
    assert engine.set_prefill_chunk(-1) == 0  # no cap


def test_the_vllm_plugin_sets_the_threshold_vllm_reads_every_step() -> None:
    core = SimpleNamespace(
        scheduler=SimpleNamespace(scheduler_config=SimpleNamespace(long_prefill_token_threshold=256))
    )
    assert _set_prefill_chunk(core, 608) == 608
    assert core.scheduler.scheduler_config.long_prefill_token_threshold == 608
