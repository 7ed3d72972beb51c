"""``tailcut bench predictor``: what the output-length predictor costs per admission, and how well it
learns on the seed-mix reply lengths (WORKLOADS.md), against the fixed per-tier prior.

Both are measured in one run on the same synthetic trace; the cost is wall time per ``predict`` call
on this machine (noisy: read it against the 1 ms budget, not as an absolute).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass

from admission.predictor import TIER_PRIOR_TOKENS, OutputLengthPredictor
from queues.keys import Tier

# seed-mix: (share, tier, prompt tokens range, output tokens range)
SEED_MIX: list[tuple[float, Tier, tuple[int, int], tuple[int, int]]] = [
    (0.60, "realtime", (20, 120), (16, 64)),
    (0.25, "normal", (128, 512), (64, 256)),
    (0.15, "background", (512, 2048), (256, 1024)),
]
TENANTS = [f"tenant-{index}" for index in range(50)]


@dataclass
class PredictorReport:
    calls: int
    mean_us: float
    p50_us: float
    p99_us: float
    max_us: float
    budget_us: float
    mae_learned_tokens: float
    mae_prior_tokens: float


def _request(rng: random.Random) -> tuple[Tier, str, int, int]:
    draw = rng.random()
    for share, tier, prompt, output in SEED_MIX:
        if draw < share:
            return tier, rng.choice(TENANTS), rng.randint(*prompt), rng.randint(*output)
        draw -= share
    _share, tier, prompt, output = SEED_MIX[-1]
    return tier, rng.choice(TENANTS), rng.randint(*prompt), rng.randint(*output)


def run(*, calls: int = 100_000, seed: int = 0) -> PredictorReport:
    rng = random.Random(seed)
    predictor = OutputLengthPredictor()
    trace = [_request(rng) for _ in range(calls)]
    timings_ns: list[int] = []
    errors_learned: list[int] = []
    errors_prior: list[int] = []
    clock = time.perf_counter_ns
    for tier, tenant, prompt_tokens, output_tokens in trace:
        started = clock()
        predicted = predictor.predict(tier=tier, tenant=tenant, prompt_tokens=prompt_tokens, max_tokens=4096)
        timings_ns.append(clock() - started)
        errors_learned.append(abs(predicted - output_tokens))
        errors_prior.append(abs(TIER_PRIOR_TOKENS[tier] - output_tokens))
        predictor.observe(tier=tier, tenant=tenant, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    timings_ns.sort()
    return PredictorReport(
        calls=calls,
        mean_us=statistics.fmean(timings_ns) / 1000,
        p50_us=timings_ns[len(timings_ns) // 2] / 1000,
        p99_us=timings_ns[int(len(timings_ns) * 0.99)] / 1000,
        max_us=timings_ns[-1] / 1000,
        budget_us=1000.0,
        mae_learned_tokens=statistics.fmean(errors_learned),
        mae_prior_tokens=statistics.fmean(errors_prior),
    )


def as_dict(report: PredictorReport) -> dict[str, float | int]:
    return asdict(report)
