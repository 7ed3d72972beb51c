"""Side run (SIMULATOR): the slow-step rule over a run's first minute and the rest, for one ``side_runs.py``
grid variant on one workload's 90% trace (seed S's suite trace): the share of rounds the rule found the
steps slow, and the mean of its recent and usual step times and of the step time. From the repository
root:

    .venv/bin/python docs/benchmarks/policies-suite/side-trace-work/usual_at_start.py long-history shipped 2
"""

import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.simrun import simulate
from bench.workloads import make_trace
from workers import scheduler as schedmod

sys.path.insert(0, str(Path(__file__).parents[1]))
import side_runs  # type: ignore[import-not-found]

STRETCHES_MS = ((0, 5_000), (5_000, 10_000), (10_000, 20_000), (20_000, 30_000), (30_000, 60_000), (60_000, 360_000))


def main() -> None:
    name, spec, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    side_runs.patch_sizes(spec)
    rounds: list[tuple[int, bool, float, float, float]] = []
    slow_steps = schedmod.TailcutPolicy.slow_steps

    def logged(self: Any, step_ms: float, now_ms: int) -> bool:
        slow = bool(slow_steps(self, step_ms, now_ms))
        rounds.append((now_ms, slow, self._recent_step.value, self._usual_step.value, step_ms))
        return slow

    schedmod.TailcutPolicy.slow_steps = logged  # type: ignore[method-assign]
    job = side_runs.seed_job(name, spec, seed)
    trace = make_trace(job.workload, job.rate_rps, seed=seed, duration_s=job.duration_s)
    simulate(trace, job.workload, job.config(), duration_s=job.duration_s)
    table = np.array(rounds, dtype=float)
    print(f"{name} {spec} seed {seed}:")
    for start_ms, end_ms in STRETCHES_MS:
        part = table[(table[:, 0] >= start_ms) & (table[:, 0] < end_ms)]
        slow, recent, usual, step = part[:, 1:].mean(axis=0)
        print(
            f"  {start_ms // 1000}-{end_ms // 1000} s: slow in {slow:.0%} of rounds; recent {recent:.2f} ms,",
            f"usual {usual:.2f} ms, step {step:.2f} ms",
        )


if __name__ == "__main__":
    main()
