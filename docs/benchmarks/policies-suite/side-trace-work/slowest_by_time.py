"""Side run (SIMULATOR): when the slowest 1% of realtime replies arrived, for one ``side_runs.py`` grid
variant on one workload's 90% trace (seed S's suite trace), and the realtime P99 E2E over the replies
that arrived after the first 30 and 60 seconds. From the repository root:

    .venv/bin/python docs/benchmarks/policies-suite/side-trace-work/slowest_by_time.py long-history shipped 1
"""

import itertools
import sys
from pathlib import Path

import numpy as np

from bench.simrun import floor_e2e_ms, simulate
from bench.workloads import make_trace

sys.path.insert(0, str(Path(__file__).parents[1]))
import side_runs  # type: ignore[import-not-found]

EDGES_S = (0, 30, 60, 120, 180, 240, 300, 360)


def main() -> None:
    name, spec, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    side_runs.patch_sizes(spec)
    job = side_runs.seed_job(name, spec, seed)
    workload, cost = job.workload, job.cost
    trace = make_trace(workload, job.rate_rps, seed=seed, duration_s=job.duration_s)
    run = simulate(trace, workload, job.config(), duration_s=job.duration_s)
    # (arrival s, E2E ms) of every realtime reply that finished
    replies = [(r.arrival.at_s, r.e2e_ms) for r in run.records if r.arrival.tier == "realtime" and r.e2e_ms is not None]
    floor_ms = floor_e2e_ms(workload, cost, job.rate_rps, "realtime")
    p99 = float(np.percentile([e2e_ms for _, e2e_ms in replies], 99))
    slowest = [at_s for at_s, e2e_ms in replies if e2e_ms >= p99]
    counts = np.histogram(slowest, bins=EDGES_S)[0].tolist()
    print(
        f"{name} {spec} seed {seed}: realtime P99 E2E {p99:.1f} ms = {p99 / floor_ms:.3f}x the floor;",
        f"the {len(slowest)} slowest arrived in {list(itertools.pairwise(EDGES_S))} s: {counts}",
    )
    for after_s in (30, 60):
        later = float(np.percentile([e2e_ms for at_s, e2e_ms in replies if at_s >= after_s], 99))
        print(f"  over the replies that arrived after {after_s} s: {later / floor_ms:.3f}x the floor")


if __name__ == "__main__":
    main()
