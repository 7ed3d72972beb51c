"""Workloads and their traces: seed-mix unchanged, gamma bursts, tenant shares, sessions, dataset lengths."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from bench.lengthtable import LengthTableError, chat_messages, exchanges, load_table, shipped_tables, table_json
from bench.simrun import SimConfig, fifo_capacity_rps, floor_e2e_ms, simulate
from bench.workloads import (
    Arrival,
    Arrivals,
    Workload,
    WorkloadError,
    draw_requests,
    interarrival_gaps,
    load_workload,
    make_trace,
    poisson_trace,
    require_realtime,
    session_token_ids,
    shipped_workloads,
    sim_session_token_ids,
)
from tailcut.errors import FatalError
from workers.engines.costmodel import PROFILES

H100 = PROFILES["h100-llama3-8b"]
SEED_MIX = load_workload("seed-mix")
TABLE = load_table("sharegpt-smollm2")


def _key(trace: list[Arrival]) -> str:
    rows = [(a.index, round(a.at_s, 9), a.tier, a.tenant, a.prompt_tokens, a.output_tokens) for a in trace]
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def _workload(**fields: object) -> Workload:
    base: dict[str, object] = {
        "name": "test",
        "tenants": ["a", "b", "c"],
        "tiers": [
            {"tier": "realtime", "share": 0.6, "prompt_tokens": [20, 120], "output_tokens": [16, 64]},
            {"tier": "background", "share": 0.4, "prompt_tokens": [512, 2048], "output_tokens": [256, 1024]},
        ],
    }
    return Workload.model_validate(base | fields)


# --- seed-mix: the same seed draws the trace it drew before workloads had datasets and sessions ----------


def test_seed_mix_draws_exactly_the_trace_it_always_drew() -> None:
    # Recorded on the tree before issue 12 (bench/workloads.py at cd19ab5).
    trace = poisson_trace(SEED_MIX, 90.0, seed=0, duration_s=120.0)
    assert len(trace) == 10710
    assert trace[1] == Arrival(1, 0.009806812255771676, "realtime", "acme", 40, 56)
    assert trace[5001] == Arrival(5001, 55.96143953761141, "background", "acme", 1328, 308)
    assert trace[-1] == Arrival(10709, 119.99843797779705, "realtime", "globex", 98, 34)
    assert _key(trace) == "b7e2eec526a455d7251c4fbefde38d16c3c151aab6879847eeb7f227c4493245"
    capacity_trace = draw_requests(SEED_MIX, 3000, np.random.default_rng([0, 3]))
    digest = hashlib.sha256(
        repr([(a.index, a.tier, a.tenant, a.prompt_tokens, a.output_tokens) for a in capacity_trace]).encode()
    ).hexdigest()
    assert digest == "841a99e308481d26b339568c19149b575714b36652d3834ab629b1e3562b7953"
    assert make_trace(SEED_MIX, 90.0, seed=0, duration_s=120.0) == trace


def test_seed_mix_floor_is_unchanged() -> None:
    # The formula of the tree before issue 12: uniform replies, the tier's longest prompt in one step.
    rate = 90.0
    load = rate * (17.25 * 314 + 6.00 * 160) / 1e6
    step = 5753 / (1 - load)
    expected = (max(step, H100.step_us(120, 0)) + (16 + 0.99 * 48 - 1) * step) / 1000
    assert floor_e2e_ms(SEED_MIX, H100, rate, "realtime") == pytest.approx(expected)


# --- arrivals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [0.3, 0.5, 1.0, 2.0])
def test_gamma_gaps_have_mean_one_over_rate_and_cv_one_over_sqrt_burstiness(burstiness: float) -> None:
    rate = 40.0
    gaps = interarrival_gaps(Arrivals(process="gamma", burstiness=burstiness), rate, 200_000, np.random.default_rng(7))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.01)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.02)


def test_poisson_gaps_are_exponential() -> None:
    gaps = interarrival_gaps(Arrivals(), 40.0, 200_000, np.random.default_rng(7))
    assert gaps.mean() == pytest.approx(1 / 40.0, rel=0.01)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.02)


def test_bursty_sends_seed_mix_requests_in_bursts() -> None:
    bursty = load_workload("bursty")
    assert bursty.arrivals == Arrivals(process="gamma", burstiness=0.4)
    trace = make_trace(bursty, 90.0, seed=0, duration_s=120.0)
    # seed-mix's requests, drawn as seed-mix draws them, at gamma gaps.
    assert trace == make_trace(SEED_MIX, 90.0, seed=0, duration_s=120.0, burstiness=0.4)
    assert {mix.tier: mix for mix in bursty.tiers} == {mix.tier: mix for mix in SEED_MIX.tiers}
    gaps = np.diff([a.at_s for a in trace])
    assert len(trace) == pytest.approx(90.0 * 120, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(0.4), rel=0.1)


def test_a_burstiness_override_makes_any_workload_gamma() -> None:
    trace = make_trace(SEED_MIX, 50.0, seed=1, count=20_000, burstiness=0.25)
    gaps = np.diff([a.at_s for a in trace])
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.05)


def test_poisson_with_a_burstiness_is_refused() -> None:
    with pytest.raises(ValueError, match="needs process 'gamma'"):
        Arrivals(process="poisson", burstiness=0.5)


# --- tenants -----------------------------------------------------------------------------------------


def test_tenant_shares_are_the_trace_shares_in_every_tier() -> None:
    workload = _workload(tenant_shares=[0.6, 0.3, 0.1])
    trace = make_trace(workload, 100.0, seed=0, count=20_000)
    for tier in ("realtime", "background"):
        counts = Counter(a.tenant for a in trace if a.tier == tier)
        total = sum(counts.values())
        for tenant, share in zip(workload.tenants, [0.6, 0.3, 0.1], strict=True):
            sigma = np.sqrt(total * share * (1 - share))
            assert abs(counts[tenant] - total * share) < 5 * sigma, (tier, tenant, counts)
    assert Counter(a.tier for a in trace)["realtime"] == pytest.approx(0.6 * 20_000, rel=0.03)


def test_tenants_share_equally_by_default() -> None:
    counts = Counter(a.tenant for a in make_trace(SEED_MIX, 100.0, seed=0, count=20_000))
    assert set(counts) == set(SEED_MIX.tenants)
    assert all(count == pytest.approx(5000, rel=0.05) for count in counts.values())


def test_tenant_shares_must_match_the_tenants() -> None:
    with pytest.raises(ValueError, match="one share per tenant"):
        _workload(tenant_shares=[0.5, 0.5])
    with pytest.raises(ValueError, match="add up to 1"):
        _workload(tenant_shares=[0.5, 0.3, 0.3])


# --- sessions ----------------------------------------------------------------------------------------


def _session_workload() -> Workload:
    return _workload(
        tiers=[
            {
                "tier": "realtime",
                "share": 0.5,
                "prompt_tokens": [20, 120],
                "output_tokens": [16, 64],
                "sessions": {"turns": [2, 6], "turn_gap_s": [3.0, 6.0], "max_prompt_tokens": 700},
            },
            {"tier": "background", "share": 0.5, "prompt_tokens": [512, 2048], "output_tokens": [256, 1024]},
        ]
    )


def test_a_later_turn_repeats_the_earlier_turns_and_replies_as_its_prefix() -> None:
    workload = _session_workload()
    trace = make_trace(workload, 40.0, seed=3, duration_s=60.0)
    by_index = {a.index: a for a in trace}
    later = [a for a in trace if a.previous is not None]
    assert len(later) > 300
    for arrival in later:
        previous = by_index[arrival.previous]  # type: ignore[index]
        assert previous.session == arrival.session and previous.turn == arrival.turn - 1
        assert arrival.history_tokens == previous.prompt_tokens + previous.output_tokens
        assert 20 <= arrival.prompt_tokens - arrival.history_tokens <= 120  # its own question
        assert arrival.prompt_tokens <= 700
        assert 3.0 <= arrival.at_s - previous.at_s <= 6.0
        assert arrival.index > previous.index
        session = arrival.session
        assert session is not None
        sim_ids = sim_session_token_ids(session, arrival.prompt_tokens)
        assert sim_ids[: previous.prompt_tokens] == sim_session_token_ids(session, previous.prompt_tokens)
        live_ids = session_token_ids(session, arrival.prompt_tokens, low=100, high=1000, salt=5)
        assert live_ids[: previous.prompt_tokens] == session_token_ids(
            session, previous.prompt_tokens, low=100, high=1000, salt=5
        )
    sessions = [a.session for a in trace if a.turn == 0 and a.session is not None]
    assert len(set(sessions)) == len(sessions)
    first, second = sessions[:2]
    assert session_token_ids(first, 50, low=100, high=1000) != session_token_ids(second, 50, low=100, high=1000)
    assert not set(sim_session_token_ids(first, 500)) & set(sim_session_token_ids(second, 500))
    # Sessions under way when the window opens: their turns in it have a history but no previous turn.
    assert any(a.turn > 0 and a.previous is None and a.history_tokens > 0 for a in trace)


def test_session_tiers_keep_their_share_of_requests() -> None:
    workload = _session_workload()
    trace = make_trace(workload, 40.0, seed=0, count=20_000)
    share = sum(a.tier == "realtime" for a in trace) / len(trace)
    assert share == pytest.approx(0.5, abs=0.02)
    rate = len(trace) / trace[-1].at_s
    assert rate == pytest.approx(40.0, rel=0.05)


def test_the_same_seed_draws_the_same_session_trace() -> None:
    workload = load_workload("long-history")
    first = make_trace(workload, 50.0, seed=4, duration_s=20.0)
    assert first == make_trace(workload, 50.0, seed=4, duration_s=20.0)
    assert first != make_trace(workload, 50.0, seed=5, duration_s=20.0)


def test_the_simulator_serves_a_session_prefix_from_its_cache() -> None:
    workload = _session_workload()
    trace = make_trace(workload, 5.0, seed=1, duration_s=40.0)
    run = simulate(trace, workload, SimConfig(policy="fifo", cost=H100), duration_s=40.0)
    by_index = {a.index: a for a in trace}
    later = [r for r in run.records if r.arrival.previous is not None]
    assert later and all(r.status == "ok" for r in run.records)
    for record in later:
        previous = by_index[record.arrival.previous]  # type: ignore[index]
        # The previous turn's prompt blocks hit; its reply was generated by the engine, not planned.
        assert record.cached_prompt_tokens == previous.prompt_tokens // 16 * 16
    assert all(r.cached_prompt_tokens == 0 for r in run.records if r.arrival.history_tokens == 0)
    assert all(r.queue_wait_ms is not None and r.queue_wait_ms >= 0 for r in run.records)


# --- dataset lengths ---------------------------------------------------------------------------------


def test_the_shipped_length_table_loads() -> None:
    assert shipped_tables() == ["sharegpt-smollm2"]
    assert TABLE.num_complete_conversations == 17_671
    assert len(TABLE.conversations) == 3000 and TABLE.tokenizer == "SmolLM2-135M-Instruct"
    assert "scripts/make-sharegpt-lengths" in TABLE.how and TABLE.seed == 0
    assert all(1 <= len(c.turns) <= 8 for c in TABLE.conversations)
    assert len({c.id for c in TABLE.conversations}) == 3000
    replies = [turn.reply_tokens for c in TABLE.conversations for turn in c.turns]
    assert 200 < np.median(replies) < 400  # ShareGPT's replies are long: a few hundred tokens


def test_a_table_survives_writing_and_reading(tmp_path: Path) -> None:
    path = tmp_path / "copy.json"
    path.write_bytes(table_json(TABLE))
    assert load_table(str(path)) == TABLE
    (tmp_path / "bad.json").write_bytes(b'{"name": "x"}')
    with pytest.raises(LengthTableError, match="not a length table"):
        load_table(str(tmp_path / "bad.json"))
    with pytest.raises(LengthTableError, match="no length table named"):
        load_table("nope")


@dataclass(frozen=True)
class _Turn:
    role: str
    text: str


@dataclass(frozen=True)
class _Conversation:
    id: str
    turns: tuple[_Turn, ...]


def test_exchanges_pair_questions_with_replies_from_the_first_question_on() -> None:
    # A split conversation's later part opens with a reply; an empty question ends it.
    roles = [("gpt", "tail of an answer"), ("human", "q1"), ("gpt", "r1"), ("human", "q2"), ("gpt", "r2")]
    conversation = _Conversation("x_1", tuple(_Turn(role, text) for role, text in roles))
    assert exchanges(conversation) == [("q1", "r1"), ("q2", "r2")]
    assert exchanges(conversation, max_turns=1) == [("q1", "r1")]
    broken = _Conversation("y", (_Turn("human", "q1"), _Turn("gpt", "r1"), _Turn("human", " "), _Turn("gpt", "r")))
    assert exchanges(broken) == [("q1", "r1")]
    assert chat_messages(conversation, 1) == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    with pytest.raises(IndexError):
        chat_messages(conversation, 2)


def test_dataset_tiers_draw_first_turns_within_their_bounds() -> None:
    workload = _workload(
        tiers=[
            {"tier": "realtime", "share": 0.7, "prompt_tokens": [4, 64], "output_tokens": [4, 200], "dataset": {}},
            {"tier": "normal", "share": 0.3, "prompt_tokens": [500, 1024], "output_tokens": [4, 1024], "dataset": {}},
        ]
    )
    first_turns = {c.id: c.turns[0] for c in TABLE.conversations}
    trace = make_trace(workload, 50.0, seed=0, count=5000)
    bounds = {"realtime": ((4, 64), (4, 200)), "normal": ((500, 1024), (4, 1024))}
    for arrival in trace:
        (p_low, p_high), (o_low, o_high) = bounds[arrival.tier]
        assert p_low <= arrival.prompt_tokens <= p_high and o_low <= arrival.output_tokens <= o_high
        turn = first_turns[arrival.source]  # type: ignore[index]
        assert (turn.question_tokens, turn.reply_tokens) == (arrival.prompt_tokens, arrival.output_tokens)
        assert arrival.session is None
    # Every conversation that passes the realtime filter can be drawn, and no other.
    passing = {
        c.id
        for c in TABLE.conversations
        if 4 <= c.turns[0].question_tokens <= 64 and 4 <= c.turns[0].reply_tokens <= 200
    }
    drawn = {a.source for a in trace if a.tier == "realtime"}
    assert drawn <= passing and len(drawn) > 0.8 * len(passing)
    mix = workload.mix("realtime")
    lengths = [(t.question_tokens, t.reply_tokens) for c in TABLE.conversations if c.id in passing for t in c.turns[:1]]
    assert mix.mean_prompt_tokens == pytest.approx(np.mean([q for q, _ in lengths]))
    assert mix.output_tokens_at(0.99) == pytest.approx(np.quantile([r for _, r in lengths], 0.99))


def test_dataset_sessions_follow_their_conversation_turn_by_turn() -> None:
    workload = _workload(
        tiers=[
            {
                "tier": "realtime",
                "share": 1.0,
                "prompt_tokens": [1, 256],
                "output_tokens": [4, 256],
                "dataset": {"table": "sharegpt-smollm2"},
                "sessions": {"turns": [2, 8], "turn_gap_s": [5, 10], "max_prompt_tokens": 1536},
            }
        ]
    )
    conversations = {c.id: c.turns for c in TABLE.conversations}
    trace = make_trace(workload, 20.0, seed=0, duration_s=60.0)
    by_index = {a.index: a for a in trace}
    assert any(a.turn >= 2 for a in trace)
    for arrival in trace:
        turns = conversations[arrival.source]  # type: ignore[index]
        history = sum(t.question_tokens + t.reply_tokens for t in turns[: arrival.turn])
        assert arrival.history_tokens == history
        assert arrival.prompt_tokens == history + turns[arrival.turn].question_tokens <= 1536
        assert arrival.output_tokens == turns[arrival.turn].reply_tokens <= 256
        if arrival.previous is not None:
            assert by_index[arrival.previous].source == arrival.source


def test_a_filter_nothing_passes_is_refused() -> None:
    with pytest.raises(ValueError, match="no conversation of length table"):
        _workload(
            tiers=[{"tier": "realtime", "share": 1.0, "prompt_tokens": [1, 2], "output_tokens": [1, 1], "dataset": {}}]
        )


# --- shipped workloads -------------------------------------------------------------------------------


def test_at_least_three_workloads_beside_seed_mix_that_differ() -> None:
    names = shipped_workloads()
    assert {"seed-mix", "sharegpt-chat", "bursty", "long-history"} <= set(names)
    workloads = {name: load_workload(name) for name in names}
    assert any(mix.dataset for mix in workloads["sharegpt-chat"].tiers)
    assert workloads["bursty"].arrivals.burstiness < 1
    assert any(mix.sessions for mix in workloads["long-history"].tiers)
    assert any(w.tenant_shares and len(set(w.tenant_shares)) > 1 and len(w.tenants) == 3 for w in workloads.values())
    for workload in workloads.values():
        assert workload.mix("realtime").slo.ttft_ms is not None


def test_an_unknown_workload_names_the_shipped_ones() -> None:
    with pytest.raises(WorkloadError, match="long-history"):
        load_workload("nope")


def test_a_session_workload_capacity_leaves_out_prefix_cache_hits_a_saturation_run_invents() -> None:
    # Sent at once, later turns hit their history far more often than an open-loop trace lets them.
    workload = _session_workload()
    trace = draw_requests(workload, 600, np.random.default_rng([0, 3]))
    with_cache = simulate(trace, workload, SimConfig(policy="fifo", cost=H100, drain_s=float("inf")), duration_s=0.0)
    realtime = [r for r in with_cache.records if r.arrival.tier == "realtime"]
    history = sum(r.arrival.history_tokens for r in realtime)
    assert sum(r.cached_prompt_tokens for r in realtime) > 0.5 * history > 0
    capacity = fifo_capacity_rps(workload, H100, seed=0, num_requests=600)
    no_cache = SimConfig(policy="fifo", cost=H100, prefix_cache=False)
    assert capacity == fifo_capacity_rps(workload, H100, seed=0, num_requests=600, base=no_cache)
    cached = SimConfig(policy="fifo", cost=H100)
    seed_capacity = fifo_capacity_rps(SEED_MIX, H100, seed=0, num_requests=600, base=cached)
    assert seed_capacity == fifo_capacity_rps(SEED_MIX, H100, seed=0, num_requests=600)


def test_a_realtime_measurement_on_a_workload_without_realtime_says_so() -> None:
    require_realtime(SEED_MIX, "tailcut bench live")
    batch_only = Workload.model_validate(
        {
            "name": "batch-only",
            "tenants": ["a"],
            "tiers": [{"tier": "background", "share": 1.0, "prompt_tokens": [512, 2048], "output_tokens": [64, 256]}],
        }
    )
    with pytest.raises(FatalError, match=r"tailcut bench live measures the realtime tier.*'batch-only' has none"):
        require_realtime(batch_only, "tailcut bench live")
