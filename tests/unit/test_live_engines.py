"""The model-free engines a worker can run: ``null`` (zero cost) and ``sim`` (the SIMULATOR in real time).

Each is driven through the ``Engine`` protocol as the worker drives it. Wall-clock assertions are
lower bounds (a step never ends before its modelled duration) or exact figures the engine records;
speed is never asserted.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from pydantic import ValidationError

from queues.messages import SamplingSpec
from tailcut.errors import EngineDeadError, InvalidRequestError
from workers.engines.base import Engine, EngineDelta
from workers.engines.costmodel import PROFILES, kv_capacity_tokens
from workers.engines.factory import start_engine
from workers.engines.filler import FillerToken, filler_token
from workers.engines.null import NullEngine
from workers.engines.sim import SimEngine
from workers.engines.sim_live import RealtimeSimEngine
from workers.engines.steplog import StepLog
from workers.settings import EngineSettings, WorkerSettings

H100 = PROFILES["h100-llama3-8b"]
FILLER = FillerToken(token_id=7, text=" x")
ROOT = Path(__file__).parents[2]
# Sleeps may end up to the clock's resolution early; lower bounds allow this much.
EPSILON_S = 0.001


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder with only what the model-free engines read: a byte-level BPE tokenizer and a config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tokenizer-only")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["x ok the a x x ok"] * 50, trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    return folder


def spec(max_tokens: int, **kwargs: object) -> SamplingSpec:
    return SamplingSpec(max_tokens=max_tokens, temperature=0.0, **kwargs)  # type: ignore[arg-type]


async def collect(
    engine: Engine, request_id: str, prompt: list[int], max_tokens: int, priority: int = 0
) -> list[EngineDelta]:
    return [delta async for delta in engine.generate(request_id, prompt, spec(max_tokens), priority=priority)]


def token_ids(deltas: list[EngineDelta]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


def make_sim(time_scale: float = 1.0, step_log: StepLog | None = None, **kwargs: object) -> RealtimeSimEngine:
    options: dict[str, object] = {
        "kv_capacity_tokens": 100_000,
        "policy": "priority",
        "output_token_id": FILLER.token_id,
    }
    options.update(kwargs)
    sim = SimEngine(H100, **options)  # type: ignore[arg-type]
    return RealtimeSimEngine(sim, max_model_len=4096, filler=FILLER, time_scale=time_scale, step_log=step_log)


# --- null -------------------------------------------------------------------------------------------


async def test_null_engine_gives_exactly_max_tokens_filler_tokens_then_length() -> None:
    engine = NullEngine(max_model_len=512, filler=FILLER)
    deltas = await collect(engine, "r", [1, 2, 3], 17)
    assert token_ids(deltas) == [FILLER.token_id] * 17
    assert "".join(delta.text for delta in deltas) == " x" * 17
    assert [delta.finish_reason for delta in deltas if delta.finished] == ["length"]
    assert deltas[-1].finished and engine.num_unfinished() == 0
    # min_tokens and ignore_eos change nothing: it never stops early.
    more = [d async for d in engine.generate("s", [1], spec(5, min_tokens=5, ignore_eos=True), priority=0)]
    assert token_ids(more) == [FILLER.token_id] * 5
    await engine.shutdown()


async def test_null_engine_gives_every_running_request_one_token_per_step() -> None:
    engine = NullEngine(max_model_len=512, filler=FILLER, step_ms=1)
    results = await asyncio.gather(*(collect(engine, f"r{index}", [index + 1], 6) for index in range(200)))
    # 200 streams, 6 steps: each step gave all 200 their token, one delta each.
    assert engine.num_steps == 6
    for deltas in results:
        assert [delta.token_ids for delta in deltas] == [[FILLER.token_id]] * 6
    await engine.shutdown()


async def test_null_engine_merges_deltas_a_slow_consumer_has_not_taken() -> None:
    engine = NullEngine(max_model_len=512, filler=FILLER)
    stream = engine.generate("slow", [1], spec(50), priority=0)
    first = await anext(stream)
    while engine.num_unfinished():
        await asyncio.sleep(0)  # the engine runs on; the consumer takes nothing
    rest = [delta async for delta in stream]
    assert len(first.token_ids) + len(token_ids(rest)) == 50
    assert len(rest) == 1 and rest[0].finish_reason == "length" and rest[0].text == " x" * len(rest[0].token_ids)
    await engine.shutdown()


async def test_null_engine_abort_and_cancel_stop_a_request_mid_stream() -> None:
    engine = NullEngine(max_model_len=100_000, filler=FILLER, step_ms=1)
    received: list[EngineDelta] = []
    async for delta in engine.generate("a", [1], spec(10_000), priority=0):
        received.append(delta)
        if len(received) == 3:
            await engine.abort("a")
    assert received[-1].finish_reason == "abort" and len(token_ids(received)) < 10_000
    assert engine.num_unfinished() == 0

    started = asyncio.Event()

    async def consume() -> None:
        async for _delta in engine.generate("c", [1], spec(10_000), priority=0):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert engine.num_unfinished() == 0
    await engine.shutdown()


async def test_null_engine_refuses_what_vllm_refuses_and_dies_loudly() -> None:
    engine = NullEngine(max_model_len=64, filler=FILLER, step_ms=1)
    assert engine.max_model_len == 64 and engine.kv_capacity_tokens >= 1 << 30
    assert await engine.set_token_budget(512) == 512
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        await collect(engine, "long", [1] * 60, 10)
    with pytest.raises(InvalidRequestError, match="empty"):
        await collect(engine, "empty", [], 10)
    stream = engine.generate("dup", [1], spec(60), priority=0)
    await anext(stream)
    with pytest.raises(InvalidRequestError, match="already running"):
        await collect(engine, "dup", [1], 10)
    await engine.shutdown()
    with pytest.raises(EngineDeadError):
        async for _delta in stream:
            pass
    with pytest.raises(EngineDeadError):
        await collect(engine, "after", [1], 10)


# --- sim in real time --------------------------------------------------------------------------------


async def test_realtime_sim_steps_take_exactly_the_cost_model_times_the_scale() -> None:
    engine = make_sim(time_scale=2.0)
    started = time.monotonic()
    results = await asyncio.gather(
        collect(engine, "chat", list(range(100, 140)), 8, priority=0),
        collect(engine, "doc", list(range(1000, 1300)), 4, priority=1),
    )
    elapsed = time.monotonic() - started
    assert [len(token_ids(deltas)) for deltas in results] == [8, 4]
    assert all(token_ids(deltas) == [FILLER.token_id] * len(token_ids(deltas)) for deltas in results)
    assert [delta.finish_reason for deltas in results for delta in deltas if delta.finished] == ["length", "length"]
    steps = list(engine.steps)
    assert len(steps) == engine.num_steps == 8  # both prompts in step 1, then decodes
    for step in steps:
        result = step.result
        assert result.duration_us == H100.step_us(result.num_prefill_tokens, result.num_decode_seqs)
        assert step.due_s - step.start_s == pytest.approx(result.duration_us * 2.0 / 1e6)
        assert step.delivered_s >= step.due_s - EPSILON_S
    assert [(step.result.num_prefill_tokens, step.result.num_decode_seqs) for step in steps[:2]] == [(340, 0), (0, 2)]
    assert elapsed >= sum(step.result.duration_us for step in steps) * 2.0 / 1e6 - EPSILON_S
    assert engine.sim.now_us == steps[-1].result.end_us
    await engine.shutdown()


async def test_realtime_sim_writes_each_request_added_and_each_step_to_its_step_log(tmp_path: Path) -> None:
    engine = make_sim(time_scale=0.5, step_log=StepLog(tmp_path / "steps.jsonl"))
    await asyncio.gather(
        collect(engine, "chat", list(range(100, 140)), 3, priority=1),
        collect(engine, "doc", list(range(1000, 1300)), 2, priority=5),
    )
    await engine.shutdown()  # closes the log
    lines = [orjson.loads(line) for line in (tmp_path / "steps.jsonl").read_bytes().splitlines()]
    adds, steps = lines[:2], lines[2:]
    assert [(line["add"], line["prompt"], line["priority"]) for line in adds] == [("chat", 40, 1), ("doc", 300, 5)]
    assert len(steps) == engine.num_steps == 3
    first, second, third = steps
    assert first["prefill"] == 340 and first["decode"] == 0 and first["ms"] == H100.step_us(340, 0) / 1000
    assert first["prefilling"] == {"chat": 40, "doc": 300} and first["admitted"] == {"chat": 0, "doc": 0}
    assert first["first"] == ["chat", "doc"] and first["budget"] == engine.sim.token_budget
    assert second["step_ms"] == first["step_ms"] + first["ms"]
    assert (second["decode"], second["prefilling"], second["first"], second["running"]) == (2, {}, [], 1)
    assert (third["decode"], third["first"], third["running"]) == (1, [], 0)  # the doc finished in step 2


async def test_realtime_sim_first_token_of_a_long_prompt_waits_for_its_prefill_step() -> None:
    engine = make_sim(time_scale=1.0)
    stream = engine.generate("long", list(range(2000)), spec(2), priority=0)
    started = time.monotonic()
    first = await anext(stream)
    waited = time.monotonic() - started
    assert first.token_ids == [FILLER.token_id]
    assert waited >= H100.step_us(2000, 0) / 1e6 - EPSILON_S  # 40 ms of modelled prefill
    assert [delta async for delta in stream][-1].finish_reason == "length"
    await engine.shutdown()


async def test_realtime_sim_idle_time_moves_the_virtual_clock_by_real_time_over_scale() -> None:
    engine = make_sim(time_scale=2.0)
    await collect(engine, "a", [1, 2, 3], 2)
    end_of_a = engine.sim.now_us
    await asyncio.sleep(0.05)
    await collect(engine, "b", [4, 5, 6], 2)
    first_b = next(step for step in engine.steps if "b" in step.result.scheduled_tokens)
    # 50 ms of real idle time at scale 2 is at least 25 ms of virtual time.
    assert first_b.result.start_us - end_of_a >= 25_000 - EPSILON_S * 1e6
    await engine.shutdown()


async def test_realtime_sim_runs_equal_priorities_in_arrival_order_and_lower_priority_first() -> None:
    engine = make_sim(time_scale=0.5, max_num_seqs=1)
    order: list[str] = []

    async def run(request_id: str, priority: int) -> None:
        async for delta in engine.generate(request_id, [hash(request_id) % 100 + 1], spec(2), priority=priority):
            if delta.finished:
                order.append(request_id)

    await asyncio.gather(run("first", 1), run("second", 1), run("urgent", 0))
    assert order == ["urgent", "first", "second"]
    await engine.shutdown()


async def test_realtime_sim_abort_and_cancel_remove_the_request_from_the_simulator() -> None:
    engine = make_sim(time_scale=0.5)
    received: list[EngineDelta] = []
    async for delta in engine.generate("a", [1, 2], spec(1000), priority=0):
        received.append(delta)
        if len(received) == 2:
            await engine.abort("a")
    assert received[-1].finish_reason == "abort"
    assert engine.num_unfinished() == 0 and engine.sim.num_unfinished() == 0

    started = asyncio.Event()

    async def consume() -> None:
        async for _delta in engine.generate("c", [1, 2], spec(1000), priority=0):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert engine.num_unfinished() == 0 and engine.sim.num_unfinished() == 0
    await engine.shutdown()


async def test_realtime_sim_continuation_hits_the_blocks_its_first_slice_left_in_the_prefix_cache() -> None:
    engine = make_sim(time_scale=0.25)
    prompt = list(range(500, 564))  # 4 full blocks
    first = await collect(engine, "r-0", prompt, 32)
    resumed = prompt + token_ids(first)  # what the worker sends for the next slice: 96 tokens
    second = await collect(engine, "r-1", resumed, 8)
    # Everything but the last (partial) block is cached, generated tokens included.
    assert second[0].num_cached_tokens == (len(resumed) - 1) // 16 * 16 == 80
    assert len(token_ids(second)) == 8
    await engine.shutdown()


async def test_realtime_sim_token_counts_and_steps_are_deterministic() -> None:
    async def run() -> tuple[list[int], list[tuple[int, int, float]]]:
        engine = make_sim(time_scale=0.25, max_num_batched_tokens=256)
        lengths = [(30 + 40 * index, 3 + index) for index in range(6)]
        results = await asyncio.gather(
            *(
                collect(engine, f"r{index}", list(range(index * 1000, index * 1000 + prompt)), out, priority=index % 2)
                for index, (prompt, out) in enumerate(lengths)
            )
        )
        steps = [(s.result.num_prefill_tokens, s.result.num_decode_seqs, s.result.duration_us) for s in engine.steps]
        await engine.shutdown()
        return [len(token_ids(deltas)) for deltas in results], steps

    first, second = await run(), await run()
    assert first == second
    assert first[0] == [3, 4, 5, 6, 7, 8]


async def test_realtime_sim_budget_capacity_and_refusals() -> None:
    engine = make_sim(kv_capacity_tokens=1024, max_num_batched_tokens=512)
    assert engine.kv_capacity_tokens == 1024 and engine.max_model_len == 4096
    assert await engine.set_token_budget(10_000) == 512
    assert await engine.set_token_budget(64) == 64 == engine.sim.token_budget
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        await collect(engine, "huge", list(range(2000)), 10)
    assert engine.num_unfinished() == 0
    assert "SIMULATOR" in repr(engine)
    await engine.shutdown()
    with pytest.raises(EngineDeadError):
        await collect(engine, "after", [1], 2)


# --- settings and the factory --------------------------------------------------------------------


def test_engine_kind_and_sim_options_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILCUT_ENGINE__KIND", "sim")
    monkeypatch.setenv("TAILCUT_ENGINE__SIM_PROFILE", "a100-llama3-8b")
    monkeypatch.setenv("TAILCUT_ENGINE__SIM_TIME_SCALE", "2.5")
    monkeypatch.setenv("TAILCUT_ENGINE__SIM_KV_CAPACITY_TOKENS", "50000")
    monkeypatch.setenv("TAILCUT_ENGINE__NULL_STEP_MS", "3")
    engine = WorkerSettings().engine
    assert (engine.kind, engine.sim_profile, engine.sim_time_scale) == ("sim", "a100-llama3-8b", 2.5)
    assert (engine.sim_kv_capacity_tokens, engine.null_step_ms) == (50000, 3.0)
    assert EngineSettings().kind == "vllm"


def test_engine_settings_refuse_unknown_profiles_and_impossible_sizes() -> None:
    with pytest.raises(ValidationError, match="TAILCUT_ENGINE__SIM_PROFILE to one of h100-llama3-8b, a100-llama3-8b"):
        EngineSettings(sim_profile="h100-mistral")
    with pytest.raises(ValidationError, match="holds no KV block of 16 tokens"):
        EngineSettings(kind="sim", sim_kv_capacity_tokens=8)
    with pytest.raises(ValidationError, match="kind"):
        EngineSettings(kind="tgi")
    with pytest.raises(ValidationError, match="sim_time_scale"):
        EngineSettings(sim_time_scale=0)


def test_filler_token_is_one_real_token_of_the_served_tokenizer(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    filler = filler_token(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.encode(filler.text, add_special_tokens=False).ids == [filler.token_id]
    assert filler.text == " x"
    assert tokenizer.decode([filler.token_id] * 3) == filler.text * 3


async def test_factory_builds_each_model_free_engine_from_settings(model_dir: Path) -> None:
    null = start_engine(EngineSettings(kind="null", null_step_ms=2), model_dir, None)
    assert isinstance(null, NullEngine) and null.max_model_len == 1024
    filler = filler_token(model_dir)
    assert token_ids(await collect(null, "n", [1], 3)) == [filler.token_id] * 3
    await null.shutdown()

    sim = start_engine(EngineSettings(kind="sim", max_num_seqs=8, sim_time_scale=0.5), model_dir, 512)
    assert isinstance(sim, RealtimeSimEngine) and sim.max_model_len == 512 and sim.time_scale == 0.5
    assert sim.sim.policy == "priority" and sim.sim.max_num_seqs == 8 and sim.sim.block_size == 16
    assert sim.sim.cost == H100 and sim.kv_capacity_tokens == kv_capacity_tokens() // 16 * 16
    deltas = await collect(sim, "s", [1, 2, 3], 3)
    assert token_ids(deltas) == [filler.token_id] * 3 and "".join(d.text for d in deltas) == filler.text * 3
    await sim.shutdown()


def test_model_free_workers_start_without_loading_torch_or_vllm(model_dir: Path) -> None:
    code = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "import workers.main\n"
        "from workers.engines.factory import start_engine\n"
        "from workers.settings import EngineSettings\n"
        "async def main():\n"
        f"    for kind in ('null', 'sim'):\n"
        f"        engine = start_engine(EngineSettings(kind=kind), Path({str(model_dir)!r}), None)\n"
        "        await engine.shutdown()\n"
        "asyncio.run(main())\n"
        "heavy = sorted(name for name in ('torch', 'vllm', 'transformers') if name in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
