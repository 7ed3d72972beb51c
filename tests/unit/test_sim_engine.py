"""The sim engine (a simulator of continuous batching on a virtual clock), one mechanism per test."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import workers.engines.sim as sim_module
from workers.engines.costmodel import PROFILES
from workers.engines.sim import SYNTHETIC_TOKEN_BASE, SimEngine, StepResult

H100 = PROFILES["h100-llama3-8b"]
ROOT = Path(__file__).parents[2]


def make_engine(kv_capacity_tokens: int = 100_000, **kwargs: Any) -> SimEngine:
    return SimEngine(H100, kv_capacity_tokens=kv_capacity_tokens, **kwargs)


def run_until_done(engine: SimEngine, max_steps: int = 10_000) -> list[StepResult]:
    steps: list[StepResult] = []
    while engine.num_unfinished():
        assert len(steps) < max_steps, "the simulator made no progress"
        steps.append(engine.step())
    return steps


def tokens_of(steps: list[StepResult], request_id: str) -> list[int]:
    return [step.new_token_ids[request_id] for step in steps if request_id in step.new_token_ids]


# --- step time -------------------------------------------------------------------------------------


def test_four_decodes_and_a_300_token_prefill_cost_exactly_the_model() -> None:
    engine = make_engine()
    for index in range(4):
        engine.add(f"d{index}", 10, max_tokens=8)
    first = engine.step()
    assert (first.num_prefill_tokens, first.num_decode_seqs) == (40, 0)
    assert first.duration_us == 5753 + 17.25 * 40
    assert list(first.new_token_ids) == ["d0", "d1", "d2", "d3"]

    engine.add("p", 300, max_tokens=8)
    mixed = engine.step()
    assert (mixed.num_prefill_tokens, mixed.num_decode_seqs) == (300, 4)
    assert mixed.duration_us == 5753 + 17.25 * 300 + 6.00 * 4 == 10_952.0
    assert mixed.start_us == first.end_us
    assert engine.now_us == first.duration_us + mixed.duration_us

    decodes = engine.step()
    assert (decodes.num_prefill_tokens, decodes.num_decode_seqs) == (0, 5)
    assert decodes.duration_us == 5753 + 6.00 * 5


def test_the_a100_profile_is_charged_when_chosen() -> None:
    engine = SimEngine(PROFILES["a100-llama3-8b"], kv_capacity_tokens=10_000)
    engine.add("a", 100, max_tokens=2)
    assert engine.step().duration_us == 16442 + 47.84 * 100
    assert engine.step().duration_us == 16442 + 18.21 * 1


def test_a_request_yields_one_token_per_step_until_max_tokens() -> None:
    engine = make_engine()
    engine.add("a", 20, max_tokens=5)
    steps = run_until_done(engine)
    assert len(steps) == 5
    assert len(set(tokens_of(steps, "a"))) == 5
    assert all(token >= SYNTHETIC_TOKEN_BASE for token in tokens_of(steps, "a"))
    assert [step.finished for step in steps] == [[], [], [], [], ["a"]]
    assert steps[-1].kv_used_blocks == 2  # KV is reported before the finished request frees it
    assert engine.num_running == engine.num_waiting == engine.num_unfinished() == 0


# --- token budget and chunked prefill --------------------------------------------------------------


def test_a_1500_token_prompt_is_chunked_512_512_476_under_a_512_budget() -> None:
    engine = make_engine(max_num_batched_tokens=2048)
    assert engine.set_token_budget(512) == 512
    engine.add("long", 1500, max_tokens=3)
    steps = [engine.step() for _ in range(3)]
    assert [step.num_prefill_tokens for step in steps] == [512, 512, 476]
    assert [step.duration_us for step in steps] == [H100.step_us(512, 0), H100.step_us(512, 0), H100.step_us(476, 0)]
    assert [list(step.new_token_ids) for step in steps] == [[], [], ["long"]]  # first token after the last chunk


def test_a_1500_token_prompt_is_one_step_at_2048() -> None:
    engine = make_engine(max_num_batched_tokens=2048)
    engine.add("long", 1500, max_tokens=3)
    step = engine.step()
    assert step.num_prefill_tokens == 1500
    assert step.duration_us == 5753 + 17.25 * 1500
    assert list(step.new_token_ids) == ["long"]


def test_running_decodes_come_first_and_the_prefill_gets_what_is_left() -> None:
    engine = make_engine(max_num_batched_tokens=512)
    for index in range(4):
        engine.add(f"d{index}", 10, max_tokens=10)
    engine.step()
    engine.add("long", 1000, max_tokens=2)
    step = engine.step()
    assert step.num_decode_seqs == 4
    assert step.num_prefill_tokens == 508
    assert step.scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "long": 508}


def test_the_token_budget_never_exceeds_its_start_value() -> None:
    engine = make_engine(max_num_batched_tokens=1024)
    assert engine.set_token_budget(4096) == 1024
    assert engine.set_token_budget(0) == 1
    assert engine.set_token_budget(700) == engine.token_budget == 700


def test_max_num_seqs_caps_the_running_set() -> None:
    engine = make_engine(max_num_seqs=3)
    for index in range(5):
        engine.add(f"r{index}", 10, max_tokens=4)
    step = engine.step()
    assert list(step.scheduled_tokens) == ["r0", "r1", "r2"]
    assert (engine.num_running, engine.num_waiting) == (3, 2)


# --- KV allocation ---------------------------------------------------------------------------------


def test_paged_allocation_admits_more_and_wastes_less_than_static_reservation() -> None:
    # 64 blocks of 16; each request holds 100 prompt tokens and may generate 60.
    def first_step(kv_allocation: Any) -> tuple[SimEngine, StepResult]:
        engine = make_engine(kv_capacity_tokens=64 * 16, kv_allocation=kv_allocation)
        for index in range(10):
            engine.add(f"r{index}", 100, max_tokens=60)
        return engine, engine.step()

    paged_engine, paged = first_step("paged")
    static_engine, static = first_step("static")
    # Paged: 7 blocks each (112 slots for 100 tokens), 9 fit. Static: 10 blocks each (160 slots), 6 fit.
    assert (paged_engine.num_running, paged.kv_used_blocks, paged.kv_filled_tokens) == (9, 63, 900)
    assert (static_engine.num_running, static.kv_used_blocks, static.kv_filled_tokens) == (6, 60, 600)
    assert paged.kv_reserved_unused_share == pytest.approx(1 - 900 / (63 * 16))
    assert static.kv_reserved_unused_share == pytest.approx(0.375)
    assert paged.kv_usage == 63 / 64

    # Run both to the end: static never preempts (its KV was reserved up front), paged must.
    paged_steps, static_steps = run_until_done(paged_engine), run_until_done(static_engine)
    assert not any(step.preempted for step in static_steps)
    assert any(step.preempted for step in paged_steps)
    assert sum(len(step.finished) for step in paged_steps) == sum(len(step.finished) for step in static_steps) == 10


def test_kv_pressure_preempts_the_latest_request_which_later_completes_all_its_tokens() -> None:
    # 8 blocks of 16. Each request: 48 prompt tokens (3 blocks), up to 87 tokens of KV (6 blocks).
    engine = make_engine(kv_capacity_tokens=8 * 16)
    engine.add("a", 48, max_tokens=40)
    engine.add("b", 48, max_tokens=40)
    steps = run_until_done(engine)
    preempting = [step for step in steps if step.preempted]
    assert preempting[0].preempted == ["b"]  # fcfs: the last admitted loses
    assert "b" not in preempting[0].scheduled_tokens
    assert len(tokens_of(steps, "a")) == len(tokens_of(steps, "b")) == 40
    assert [request_id for step in steps for request_id in step.finished] == ["a", "b"]
    assert all(step.kv_used_blocks <= step.kv_total_blocks for step in steps)
    # b recomputes its prompt and the output it had, minus what survived in the prefix cache.
    readmitted = next(step for step in steps[steps.index(preempting[0]) + 1 :] if "b" in step.scheduled_tokens)
    assert readmitted.num_prefill_tokens == readmitted.scheduled_tokens["b"] > 0
    # a's growth evicted b's tail blocks first; b's first two blocks were still cached.
    assert readmitted.num_cached_tokens == {"b": 32}
    assert readmitted.num_prefill_tokens == 48 + 17 - 32  # b had generated 17 tokens when preempted


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "c"), ("priority", "b")])
def test_the_victim_is_the_latest_or_the_lowest_priority(policy: Any, victim: str) -> None:
    # 6 blocks of 16; three 32-token prompts (2 blocks each) fill them; the first decode needs a 3rd block.
    engine = make_engine(kv_capacity_tokens=6 * 16, policy=policy)
    engine.add("a", 32, max_tokens=40, priority=0)
    engine.add("b", 32, max_tokens=40, priority=1)
    engine.add("c", 32, max_tokens=40, priority=0)
    first = engine.step()
    assert first.kv_used_blocks == 6
    second = engine.step()
    assert second.preempted == [victim]
    assert victim not in second.scheduled_tokens
    assert engine.num_waiting == 1


# --- prefix cache ----------------------------------------------------------------------------------


def complete(engine: SimEngine, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Run one request to the end; its generated token ids."""
    engine.add(request_id, prompt, max_tokens)
    return tokens_of(run_until_done(engine), request_id)


def test_a_continuation_prefills_only_the_tokens_not_in_the_prefix_cache() -> None:
    engine = make_engine()
    prompt = list(range(100))
    output = complete(engine, "a", prompt, max_tokens=20)
    assert len(output) == 20

    engine.add("a-cont", prompt + output, max_tokens=5)
    step = engine.step()
    # 119 tokens of KV were computed (the last sampled token never is): 7 full blocks = 112 cached.
    assert step.num_cached_tokens == {"a-cont": 112}
    assert step.num_prefill_tokens == 120 - 112
    assert step.duration_us == H100.step_us(8, 0)


def test_without_the_prefix_cache_a_continuation_prefills_everything() -> None:
    engine = make_engine(prefix_cache=False)
    prompt = list(range(100))
    output = complete(engine, "a", prompt, max_tokens=20)
    engine.add("a-cont", prompt + output, max_tokens=5)
    step = engine.step()
    assert step.num_prefill_tokens == 120
    assert step.num_cached_tokens == {"a-cont": 0}


def test_an_aborted_requests_blocks_stay_reusable() -> None:
    engine = make_engine()
    engine.add("a", list(range(100)), max_tokens=50)
    engine.step()
    assert engine.abort("a") and not engine.abort("a")
    assert engine.num_unfinished() == 0
    engine.add("again", list(range(100)), max_tokens=5)
    step = engine.step()
    assert step.num_cached_tokens == {"again": 96}
    assert step.num_prefill_tokens == 4


def test_a_full_prompt_hit_still_computes_the_last_token() -> None:
    engine = make_engine()
    complete(engine, "a", list(range(64)), max_tokens=1)
    engine.add("same", list(range(64)), max_tokens=1)
    step = engine.step()
    assert step.num_cached_tokens == {"same": 48}
    assert step.num_prefill_tokens == 16


def test_count_only_prompts_share_no_prefix() -> None:
    engine = make_engine()
    engine.add("a", 64, max_tokens=1)
    engine.step()
    engine.add("b", 64, max_tokens=1)
    assert engine.step().num_cached_tokens == {"b": 0}


def test_eviction_is_lru_and_takes_a_requests_tail_first() -> None:
    # 8 blocks. "a" holds 65 tokens: 4 full blocks and one with a single token.
    engine = make_engine(kv_capacity_tokens=8 * 16)
    engine.add("a", list(range(65)), max_tokens=1)
    engine.step()
    # Free queue now: 3 never-used blocks, then a's blocks tail first. 5 new blocks evict a's partial
    # block and its last full block, and leave its first three.
    engine.add("b", 80, max_tokens=1)
    engine.step()
    engine.add("a-again", list(range(65)), max_tokens=1)
    step = engine.step()
    assert step.num_cached_tokens == {"a-again": 48}
    assert step.num_prefill_tokens == 17


def test_shared_prefix_blocks_are_counted_once() -> None:
    engine = make_engine()
    engine.add("a", list(range(64)), max_tokens=10)
    engine.step()  # a: 64 tokens computed, 4 blocks + 1 for its next token later
    engine.add("b", [*range(48), 999], max_tokens=10)
    step = engine.step()
    assert step.num_cached_tokens == {"b": 48}
    # a: 5 blocks (65 tokens); b: the 3 shared blocks + 1 of its own (49 tokens).
    assert step.kv_used_blocks == 6
    assert step.kv_filled_tokens == 65 + 1


# --- clock, lifecycle, determinism ---------------------------------------------------------------


def test_an_empty_engine_steps_in_zero_time_and_idles_forward() -> None:
    engine = make_engine()
    step = engine.step()
    assert step.idle and step.duration_us == 0.0 and engine.now_us == 0.0
    assert engine.idle_until(1_000_000.0) == 1_000_000.0
    assert engine.idle_until(5.0) == 1_000_000.0  # the clock never goes back
    engine.add("a", 10, max_tokens=2)
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.idle_until(2_000_000.0)
    assert engine.step().start_us == 1_000_000.0


def test_add_rejects_duplicates_and_requests_that_can_never_fit() -> None:
    engine = make_engine(kv_capacity_tokens=4 * 16)
    engine.add("a", 10, max_tokens=2)
    with pytest.raises(ValueError, match="already"):
        engine.add("a", 10, max_tokens=2)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add("big", 60, max_tokens=10)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add("none", 10, max_tokens=0)
    with pytest.raises(ValueError, match="kv_allocation"):
        make_engine(kv_allocation="pagd")


def test_aborting_a_running_request_frees_its_blocks() -> None:
    engine = make_engine()
    engine.add("a", 100, max_tokens=10)
    engine.add("b", 100, max_tokens=10)
    assert engine.step().kv_used_blocks == 14
    engine.abort("a")
    assert engine.step().kv_used_blocks == 7
    assert engine.num_running == 1


def test_the_simulator_says_it_is_one() -> None:
    assert "SIMULATOR" in repr(make_engine())
    assert sim_module.__doc__ is not None and sim_module.__doc__.startswith("SIMULATOR")
    assert SimEngine.__doc__ is not None and "SIMULATOR" in SimEngine.__doc__


def drive(seed: int, **engine_kwargs: Any) -> list[StepResult]:
    """A small mixed open-loop run: Poisson-ish arrivals, shared prefixes, priorities, KV pressure."""
    rng = random.Random(seed)
    engine = make_engine(kv_capacity_tokens=4096, **engine_kwargs)
    arrivals: list[tuple[float, str, list[int] | int, int, int]] = []
    t_us = 0.0
    for index in range(60):
        t_us += rng.expovariate(1 / 15_000)
        prompt: list[int] | int = [7] * 32 + [rng.randrange(1000) for _ in range(rng.randint(1, 200))]
        if index % 3 == 0:
            prompt = rng.randint(20, 300)
        arrivals.append((t_us, f"r{index}", prompt, rng.randint(1, 120), rng.randint(0, 2)))
    steps: list[StepResult] = []
    pending = iter(arrivals)
    upcoming = next(pending, None)
    while upcoming is not None or engine.num_unfinished():
        while upcoming is not None and upcoming[0] <= engine.now_us:
            _, request_id, prompt, max_tokens, priority = upcoming
            engine.add(request_id, prompt, max_tokens, priority=priority)
            upcoming = next(pending, None)
        if not engine.num_unfinished() and upcoming is not None:
            engine.idle_until(upcoming[0])
            continue
        steps.append(engine.step())
        assert len(steps) < 20_000
    return steps


def digest(seed: int) -> str:
    return hashlib.sha256(repr(drive(seed)).encode()).hexdigest()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("kv_allocation", ["paged", "static"])
def test_a_run_is_deterministic_and_every_step_obeys_the_model(policy: str, kv_allocation: str) -> None:
    first = drive(1, policy=policy, kv_allocation=kv_allocation)
    assert first == drive(1, policy=policy, kv_allocation=kv_allocation)
    assert sum(len(step.finished) for step in first) == 60
    for step in first:
        assert step.duration_us == H100.step_us(step.num_prefill_tokens, step.num_decode_seqs)
        assert step.num_prefill_tokens + step.num_decode_seqs <= 2048
        assert 0 <= step.kv_filled_tokens <= step.kv_used_blocks * 16 <= 4096
    assert any(step.preempted for step in first) == (kv_allocation == "paged")
    assert any(step.num_cached_tokens and max(step.num_cached_tokens.values()) > 0 for step in first)


def test_the_same_run_in_processes_with_different_hash_seeds_is_identical() -> None:
    results = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        code = "from tests.unit.test_sim_engine import digest; print(digest(5))"
        completed = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=60
        )
        results.add(completed.stdout.strip())
    assert len(results) == 1
    assert results == {digest(5)}


# --- long prefill cap and end of sequence ----------------------------------------------------------


def test_long_prefill_threshold_spreads_a_prompt_over_steps_only_while_it_has_company() -> None:
    alone = make_engine(long_prefill_token_threshold=256)
    alone.add("a", 1000, max_tokens=2)
    assert alone.step().scheduled_tokens == {"a": 1000}  # nobody to starve: the whole prompt

    engine = make_engine(long_prefill_token_threshold=256)
    engine.add("long", 1000, max_tokens=2)
    engine.add("short", 100, max_tokens=8)
    first = engine.step()
    assert first.scheduled_tokens == {"long": 256, "short": 100}
    assert first.duration_us == H100.step_us(356, 0)
    chunks = [first.scheduled_tokens["long"]]
    while "long" not in (step := engine.step()).new_token_ids:
        chunks.append(step.scheduled_tokens["long"])
    chunks.append(step.scheduled_tokens["long"])
    assert chunks == [256, 256, 256, 232]


def test_stop_after_ends_a_request_before_max_tokens_and_static_still_reserves_the_cap() -> None:
    engine = make_engine(kv_allocation="static", block_size=16)
    engine.add("r", 32, max_tokens=64, stop_after=3)
    first = engine.step()
    assert first.kv_used_blocks == (32 + 64) // 16  # the reservation holds prompt + max_tokens
    steps = [first, *run_until_done(engine)]
    assert len(tokens_of(steps, "r")) == 3
    assert steps[-1].finished == ["r"]
