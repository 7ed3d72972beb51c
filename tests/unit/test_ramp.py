"""The cold-start ramp: 10% open in stage 1, 20% steps through stage 2, everything in stage 3."""

from __future__ import annotations

import pytest

from warmup.ramp import RampSchedule


def test_the_default_ramp_opens_ten_percent_then_twenty_percent_steps_then_everything() -> None:
    ramp = RampSchedule()  # 2 min, then 3 min
    assert ramp.steps == 4
    assert [ramp.stage(t) for t in (0, 119.9, 120, 299.9, 300, 10_000)] == [1, 1, 2, 2, 3, 3]
    # Stage 2 is four 45 s parts: 30%, 50%, 70%, 90%.
    expected = {0: 0.1, 119: 0.1, 120: 0.3, 164: 0.3, 165: 0.5, 210: 0.7, 255: 0.9, 299: 0.9, 300: 1.0}
    for elapsed_s, fraction in expected.items():
        assert ramp.fraction(elapsed_s) == pytest.approx(fraction), elapsed_s
    assert [ramp.capacity(t, 64) for t in (0, 120, 165, 210, 255, 300)] == [6, 19, 32, 44, 57, 64]
    assert ramp.capacity(0, 4) == 1, "never below one"


def test_the_capacity_never_shrinks_and_zero_durations_mean_no_ramp() -> None:
    ramp = RampSchedule(stage1_s=3, stage2_s=7)
    fractions = [ramp.fraction(t / 10) for t in range(0, 120)]
    assert fractions == sorted(fractions)
    assert fractions[0] == pytest.approx(0.1) and fractions[-1] == 1.0
    off = RampSchedule(stage1_s=0, stage2_s=0)
    assert off.stage(0) == 3 and off.fraction(0) == 1.0 and off.capacity(0, 64) == 64
    with pytest.raises(ValueError):
        RampSchedule(stage1_s=-1)
