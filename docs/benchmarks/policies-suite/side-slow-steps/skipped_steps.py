"""Side run (SIMULATOR): the engine steps that left a running request out because the step's token budget
ran out (realtime decodes apart), and the steps' time and prefill tokens, for one ``side_runs.py`` grid
variant on one workload's 90% trace (seed S's suite traces). From the repository root:

    SIDE_SUITE=docs/benchmarks/policies-suite-360s-capacity-30k/seed2/suite.json \\
        .venv/bin/python docs/benchmarks/policies-suite/side-slow-steps/skipped_steps.py long-history shipped 2
"""

import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench import policies
from workers.engines import sim as simmod

sys.path.insert(0, str(Path(__file__).parents[1]))
import side_runs  # type: ignore[import-not-found]

REALTIME_PRIORITY = 1  # TailcutPolicy.engine_priority of a realtime request (its summaries: 0)


def main() -> None:
    name, spec, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    side_runs.patch_sizes(spec)
    step = simmod.SimEngine.step
    counts = {"steps": 0, "steps leaving some out": 0, "left out": 0, "realtime decodes left out": 0}
    durations_ms: list[float] = []
    prefill_tokens: list[int] = []

    def counting(self: Any) -> Any:
        before = [request for request in self._running if request.state == "running"]
        result = step(self)
        counts["steps"] += 1
        durations_ms.append(result.duration_us / 1000)
        prefill_tokens.append(result.num_prefill_tokens)
        left = [r for r in before if r.id not in result.scheduled_tokens and r.state == "running"]
        counts["steps leaving some out"] += bool(left)
        counts["left out"] += len(left)
        counts["realtime decodes left out"] += sum(1 for r in left if r.priority <= REALTIME_PRIORITY and r.decoding)
        return result

    simmod.SimEngine.step = counting  # type: ignore[method-assign]
    job = side_runs.seed_job(name, spec, seed)
    realtime = next(row for row in policies.run_job(job).rows if row["tier"] == "realtime")
    durations, tokens = np.array(durations_ms), np.array(prefill_tokens)
    busy = durations > 0
    print(
        f"step ms mean {durations[busy].mean():.2f} p90 {np.percentile(durations[busy], 90):.2f}",
        f"p99 {np.percentile(durations[busy], 99):.2f}; prefill tokens mean {tokens[busy].mean():.0f}",
        f"p90 {np.percentile(tokens[busy], 90):.0f} p99 {np.percentile(tokens[busy], 99):.0f}",
    )
    print(
        name,
        spec,
        seed,
        counts,
        f"realtime P99 E2E / floor {realtime['p99_e2e_ms'] / realtime['floor_e2e_ms']:.3f},",
        f"P99 TTFT {realtime['p99_ttft_ms']:.1f} ms, P50 E2E {realtime['p50_e2e_ms']:.0f}, P90 E2E",
        f"{realtime['p90_e2e_ms']:.0f}",
    )


if __name__ == "__main__":
    main()
