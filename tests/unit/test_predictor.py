"""The output-length predictor: prior, online learning per tenant, fallback, cap; and its benchmark."""

from __future__ import annotations

from pathlib import Path

import orjson

from admission.predictor import TIER_PRIOR_TOKENS, OutputLengthPredictor
from tailcut.cli import main


def test_prior_until_history_then_the_learned_length_capped_by_max_tokens() -> None:
    predictor = OutputLengthPredictor(smoothing=0.5)
    assert (
        predictor.predict(tier="normal", tenant="a", prompt_tokens=50, max_tokens=4096) == TIER_PRIOR_TOKENS["normal"]
    )
    assert predictor.predict(tier="normal", tenant="a", prompt_tokens=50, max_tokens=100) == 100
    for _ in range(10):
        predictor.observe(tier="normal", tenant="a", prompt_tokens=60, output_tokens=20)
    assert predictor.predict(tier="normal", tenant="a", prompt_tokens=50, max_tokens=4096) == 20


def test_a_new_tenant_falls_back_to_the_tier_history_of_its_prompt_class() -> None:
    predictor = OutputLengthPredictor(smoothing=1.0)
    predictor.observe(tier="realtime", tenant="a", prompt_tokens=30, output_tokens=12)
    predictor.observe(tier="realtime", tenant="a", prompt_tokens=900, output_tokens=300)
    assert predictor.predict(tier="realtime", tenant="new", prompt_tokens=40, max_tokens=4096) == 12
    assert predictor.predict(tier="realtime", tenant="new", prompt_tokens=1000, max_tokens=4096) == 300
    # Other tiers keep their own prior.
    assert predictor.predict(tier="background", tenant="a", prompt_tokens=40, max_tokens=4096) == 1024


def test_tenant_history_wins_over_the_tier_average() -> None:
    predictor = OutputLengthPredictor(smoothing=1.0)
    predictor.observe(tier="normal", tenant="verbose", prompt_tokens=50, output_tokens=400)
    predictor.observe(tier="normal", tenant="terse", prompt_tokens=50, output_tokens=10)
    assert predictor.predict(tier="normal", tenant="verbose", prompt_tokens=50, max_tokens=4096) == 400
    assert predictor.predict(tier="normal", tenant="terse", prompt_tokens=50, max_tokens=4096) == 10


def test_bench_predictor_writes_its_report(tmp_path: Path) -> None:
    main(["bench", "predictor", "--calls", "3000", "--out", str(tmp_path)])
    report = orjson.loads((tmp_path / "predictor.json").read_bytes())
    assert report["calls"] == 3000
    assert 0 < report["p50_us"] <= report["p99_us"] <= report["max_us"]
    # Learning beats the fixed prior on the seed-mix lengths.
    assert report["mae_learned_tokens"] < report["mae_prior_tokens"]
