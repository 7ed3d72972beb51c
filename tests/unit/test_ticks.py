"""``workers.ticks``: periodic work in the wake-ups a busy process has anyway."""

from __future__ import annotations

import asyncio
import functools
import time

from workers.ticks import COMPACT_AT, Ticks

LONG_S = 60.0  # a slack no test waits for: whatever fires, a beat fired it


async def test_a_tick_runs_at_the_first_beat_after_its_period_not_before() -> None:
    ticks = Ticks()
    fired: list[str] = []
    ticks.call_after(10.0, lambda: fired.append("tick"), slack_s=LONG_S)
    start = time.monotonic()
    ticks.beat(start + 9.9)  # awake, but the period has not passed
    assert fired == []
    ticks.beat(start + 10.1)
    assert fired == ["tick"]
    ticks.beat(start + 30.0)  # once
    assert fired == ["tick"]


async def test_without_beats_a_tick_runs_by_its_own_timer_after_period_and_slack() -> None:
    ticks = Ticks()
    fired = asyncio.Event()
    start = time.monotonic()
    ticks.call_after(0.02, fired.set, slack_s=0.03)
    await asyncio.wait_for(fired.wait(), timeout=5)
    assert time.monotonic() - start >= 0.05 - 0.005  # the period and the slack, not the period alone


async def test_due_ticks_run_in_order_and_later_ones_wait() -> None:
    ticks = Ticks()
    fired: list[int] = []
    for period in (3, 1, 2, 5):
        ticks.call_after(float(period), functools.partial(fired.append, period), slack_s=LONG_S)
    ticks.beat(time.monotonic() + 3.5)
    assert fired == [1, 2, 3]


async def test_a_cancelled_tick_never_runs() -> None:
    ticks = Ticks()
    fired: list[str] = []
    tick = ticks.call_after(0.01, lambda: fired.append("tick"), slack_s=0.01)
    tick.cancel()
    ticks.beat(time.monotonic() + 1.0)
    await asyncio.sleep(0.05)  # past its timer too
    assert fired == []
    assert not tick.pending


async def test_wait_ends_at_a_beat_and_release_ends_every_wait() -> None:
    ticks = Ticks()
    waiting = asyncio.create_task(ticks.wait(0.0, slack_s=LONG_S))
    await asyncio.sleep(0)
    assert not waiting.done()
    ticks.beat()
    await asyncio.wait_for(waiting, timeout=1)

    stopping = [asyncio.create_task(ticks.wait(LONG_S)) for _ in range(3)]
    await asyncio.sleep(0)
    ticks.release()
    await asyncio.wait_for(asyncio.gather(*stopping), timeout=1)


async def test_cancelled_ticks_do_not_pile_up_without_beats() -> None:
    ticks = Ticks()
    kept = ticks.call_after(LONG_S, lambda: None)
    for _ in range(10 * COMPACT_AT):
        ticks.call_after(LONG_S, lambda: None).cancel()
    assert len(ticks._heap) <= COMPACT_AT
    assert kept.pending
    kept.cancel()
