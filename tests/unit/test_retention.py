"""The prefix keep-alive (``workers.retention``): which finished turns are kept, when they are touched,
and when the keeper lets go."""

from __future__ import annotations

import pytest

from workers.retention import EVICTED_SHARE, KeepAliveConfig, PrefixKeeper, block_keys

BLOCK = 16


def keeper(**config: object) -> PrefixKeeper:
    defaults: dict[str, object] = {"min_return_share": 0.0, "min_period_ms": 100}
    return PrefixKeeper(KeepAliveConfig(**{**defaults, **config}), block_tokens=BLOCK)  # type: ignore[arg-type]


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_block_keys_are_chained_and_salted_by_tenant() -> None:
    a = block_keys("acme", tokens(0, 40), BLOCK)
    assert len(a) == 2  # whole blocks only
    assert block_keys("acme", tokens(0, 33), BLOCK) == a
    assert block_keys("acme", [99, *tokens(1, 39)], BLOCK)[1] != a[1]  # a later block depends on the first
    assert block_keys("globex", tokens(0, 40), BLOCK) != a


def test_a_finished_turn_is_touched_with_its_whole_blocks_and_one_token_more() -> None:
    # Nothing allocates KV here: the LRU would keep the blocks as long as the keeper, which touches
    # them once, half a TTL after they were freed.
    keep = keeper(ttl_ms=10_000)
    keep.finished("r1", "realtime", "acme", tokens(0, 40), tokens(1000, 10), now_ms=0)
    assert keep.num_kept == 1 and keep.kept_tokens == 48
    assert keep.due(4_999, free_kv_tokens=100_000) == []
    (touch,) = keep.due(5_000, free_kv_tokens=100_000)
    assert touch.token_ids == tokens(0, 40) + tokens(1000, 9)  # 3 blocks of 16, then one token
    assert touch.num_hittable_tokens == 48 and touch.tenant == "acme" and touch.tier == "realtime"
    assert keep.due(5_050, free_kv_tokens=100_000) == []
    keep.touched(touch.id, num_cached_tokens=48)
    assert keep.num_kept == 1
    keep.due(10_001, free_kv_tokens=100_000)
    assert keep.num_kept == 0  # its TTL is over


def test_a_surge_of_allocations_brings_the_next_touch_forward() -> None:
    keep = keeper(ttl_ms=60_000, min_period_ms=10)
    keep.finished("r1", "realtime", "acme", tokens(0, 40), tokens(1000, 10), now_ms=0)
    assert keep.due(0, free_kv_tokens=10_000) == []
    # 10 KV tokens per ms from 100 ms on: 10,000 free tokens are gone in about a second.
    touched_at = None
    for now_ms in range(50, 2_000, 50):
        keep.allocated(500)
        if keep.due(now_ms, free_kv_tokens=10_000):
            touched_at = now_ms
            break
    assert touched_at is not None and touched_at < 1_000, touched_at


def test_a_turn_freed_just_before_a_surge_is_touched_before_the_surge_fills_the_free_kv() -> None:
    """The rate's averages lag a surge's onset by their window; the KV allocated since the turn was
    freed does not. After a lull, 6,000 of 10,000 free tokens are allocated within 300 ms: the LRU
    evicts the turn once the rest is, so it is touched now, though the averages still see a rate that
    would leave it a second."""
    keep = keeper(ttl_ms=60_000, min_period_ms=250)
    keep.due(0, free_kv_tokens=10_000)
    keep.finished("r1", "realtime", "acme", tokens(0, 40), tokens(1000, 10), now_ms=10_000)
    keep.due(10_000, free_kv_tokens=10_000)
    keep.allocated(2_000)
    assert keep.due(10_200, free_kv_tokens=10_000) == []  # under half the free KV, and a lull's rate
    keep.allocated(4_000)
    assert keep.due(10_200, free_kv_tokens=10_000) == []  # half of it, but not min_period_ms apart
    (touch,) = keep.due(10_300, free_kv_tokens=10_000)
    assert keep.period_ms > 300, "the rate alone would have touched it in time: the case proves nothing"
    keep.touched(touch.id, num_cached_tokens=48)
    keep.allocated(4_000)  # the count starts again at the touch
    assert keep.due(10_600, free_kv_tokens=10_000) == []
    keep.allocated(1_000)
    assert len(keep.due(10_600, free_kv_tokens=10_000)) == 1


def test_the_allocation_windows_and_the_period_floor_are_the_configured_ones() -> None:
    # The same surge (10 KV tokens per ms for 200 ms after an idle 10 s) against 100,000 free tokens:
    # a 100 ms window sees the surge's full rate (a 10 s LRU lifetime: touches every 5 s), a 100 s
    # window a fiftieth of it (250 s: the period stays at the TTL) — as a live run stretched ×200 would.
    periods = {}
    for windows in ((100,), (100_000,)):
        keep = keeper(ttl_ms=60_000, min_period_ms=10, allocation_windows_ms=windows)
        keep.due(0, free_kv_tokens=100_000)
        keep.due(10_000, free_kv_tokens=100_000)
        for now_ms in range(10_050, 10_201, 50):
            keep.allocated(500)
            keep.due(now_ms, free_kv_tokens=100_000)
        periods[windows] = keep.period_ms
    assert periods[(100,)] == pytest.approx(5_000, rel=0.2) and periods[(100_000,)] == 60_000
    floors = {}
    for floor_ms in (10, 2_000):
        full = keeper(ttl_ms=60_000, min_period_ms=floor_ms)
        full.due(0, free_kv_tokens=1_000)
        for now_ms in range(50, 501, 50):
            full.allocated(5_000)  # a full engine: its LRU turns over in about 10 ms
            full.due(now_ms, free_kv_tokens=1_000)
        floors[floor_ms] = full.period_ms
    assert floors == {10: 10, 2_000: 2_000}
    with pytest.raises(ValueError, match="allocation_windows_ms"):
        KeepAliveConfig(allocation_windows_ms=())


def test_only_the_kept_tiers_and_turns_with_a_whole_block_are_kept() -> None:
    keep = keeper()
    keep.finished("n1", "normal", "acme", tokens(0, 400), tokens(1000, 10), now_ms=0)
    keep.finished("r1", "realtime", "acme", tokens(0, 10), tokens(1000, 6), now_ms=0)
    assert keep.num_kept == 0


def test_the_touch_period_follows_the_lru_lifetime() -> None:
    keep = keeper(period_share=0.5, min_period_ms=10)
    keep.due(0, free_kv_tokens=100_000)
    for now_ms in range(0, 20_001, 100):
        keep.allocated(1_000)  # 10 KV tokens per ms enter the engine
        keep.due(now_ms, free_kv_tokens=100_000)
    # 100,000 free tokens last about 10 s at that rate: touched every 5 s.
    assert keep.period_ms == pytest.approx(5_000, rel=0.1)
    keep.allocated(1_000)
    keep.due(20_100, free_kv_tokens=1_000)  # a full engine: its LRU turns over in about 100 ms
    assert 10 <= keep.period_ms <= 60


def test_a_return_to_a_kept_turn_drops_it_and_counts() -> None:
    keep = keeper()
    first_prompt = tokens(0, 40)
    keep.finished("r1", "realtime", "acme", first_prompt, tokens(1000, 20), now_ms=0)
    keep.arrived("realtime", "globex", [*first_prompt, *tokens(1000, 20), *tokens(5000, 30)])
    assert keep.stats.returns == 0 and keep.num_kept == 1  # another tenant's cache
    keep.arrived("realtime", "acme", [*first_prompt, *tokens(1000, 20), *tokens(5000, 30)])
    assert keep.stats.returns == 1 and keep.num_kept == 0
    assert keep.return_share > 0


def test_no_touch_while_turns_do_not_come_back() -> None:
    keep = keeper(min_return_share=0.05)
    for index in range(200):
        keep.arrived("realtime", "acme", tokens(index * 1000, 40))  # single questions, never a history
        keep.finished(f"r{index}", "realtime", "acme", tokens(index * 1000, 40), tokens(9_000_000, 8), now_ms=index)
    assert not keep.touching
    assert keep.due(5_000, free_kv_tokens=10**9) == []
    assert keep.stats.touches == 0
    # Once conversations come back, touching starts.
    for index in range(190, 200):
        keep.arrived("realtime", "acme", [*tokens(index * 1000, 40), *tokens(9_000_000, 8), 7, 7, 7])
    assert keep.touching


def test_expired_turns_and_the_oldest_over_the_kv_share_are_let_go() -> None:
    keep = keeper(ttl_ms=1_000, max_share_of_free=0.5)
    keep.finished("old", "realtime", "acme", tokens(0, 64), [], now_ms=0)
    keep.finished("new", "realtime", "acme", tokens(100, 64), [], now_ms=500)
    assert keep.kept_tokens == 96  # 48 + 48: the last token of each is computed, not kept
    keep.due(600, free_kv_tokens=100)  # 96 > half of 100: the oldest goes
    assert keep.num_kept == 1 and keep.kept_tokens == 48
    keep.due(1_600, free_kv_tokens=10**6)
    assert keep.num_kept == 0


def test_a_touch_that_finds_its_prefix_evicted_ends_the_turn() -> None:
    keep = keeper(ttl_ms=200)
    keep.finished("r1", "realtime", "acme", tokens(0, 64), tokens(1000, 1), now_ms=0)
    (touch,) = keep.due(100, free_kv_tokens=10**6)
    keep.touched(touch.id, num_cached_tokens=int(EVICTED_SHARE * touch.num_hittable_tokens) - 1)
    assert keep.num_kept == 0 and keep.stats.evicted == 1


def test_the_same_prompt_again_keeps_only_the_newer_turn() -> None:
    keep = keeper(ttl_ms=200)
    keep.finished("r1", "realtime", "acme", tokens(0, 40), tokens(1000, 9), now_ms=0)
    keep.finished("r2", "realtime", "acme", tokens(0, 40), tokens(2000, 9), now_ms=10)
    assert keep.num_kept == 1
    (touch,) = keep.due(110, free_kv_tokens=10**6)
    assert touch.token_ids[40:] == tokens(2000, 9)


def test_off_keeps_nothing() -> None:
    keep = keeper(ttl_ms=0)
    keep.finished("r1", "realtime", "acme", tokens(0, 40), tokens(1000, 9), now_ms=0)
    assert keep.num_kept == 0 and keep.due(10_000, free_kv_tokens=10**6) == []
