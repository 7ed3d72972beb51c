"""Side experiment for issue 12 (SIMULATOR, not shipped): tailcut at 100% of fifo's capacity with a larger
budget floor (``floor=N``: ``BudgetConfig.min_tokens``) or without shedding background (``noshed``), beside
the policy as shipped (``shipped``). Run from the repository root:
``.venv/bin/python PATH long-history,seed-mix shipped,floor=1536,noshed 1.0``. The capacities are the
suite's (``suite.json``); seed 0, 120 virtual s, as the suite runs."""

import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from admission.shedding import ShedLimits
from bench import policies
from bench.workloads import workload_and_cost

CAPACITY_RPS = {
    "bursty": 101.32557066878044,
    "long-history": 55.87452244525838,
    "seed-mix": 101.32557066878044,
    "sharegpt-chat": 67.0454965361887,
}


def variant(spec: str) -> policies.Variant:
    shipped = next(variant for variant in policies.variants() if variant.label == "tailcut")
    kind, _, value = spec.partition("=")
    if kind == "shipped":
        return shipped
    if kind == "floor":
        budget = replace(shipped.scheduler.budget, min_tokens=int(value))
        return replace(shipped, label=spec, scheduler=replace(shipped.scheduler, budget=budget))
    if kind == "noshed":
        return replace(shipped, label=spec, shed=ShedLimits(background=0))
    raise SystemExit(f"unknown variant {spec!r}")


def one(args: tuple[str, str, float]) -> tuple[str, str, float, dict[str, dict[str, Any]]]:
    name, spec, load = args
    workload, cost = workload_and_cost(name, "h100-llama3-8b")
    job = policies.Job(variant(spec), load, load * CAPACITY_RPS[name], 0, 120.0, workload, cost)
    return name, spec, load, {row["tier"]: row for row in policies.run_job(job).rows}


if __name__ == "__main__":
    jobs = [
        (name, spec, float(load))
        for name in sys.argv[1].split(",")
        for spec in sys.argv[2].split(",")
        for load in sys.argv[3].split(",")
    ]
    with ProcessPoolExecutor(2) as pool:
        for name, spec, load, rows in pool.map(one, jobs):
            realtime, background = rows["realtime"], rows["background"]
            print(
                f"{name} {spec} {load}: realtime P99 E2E {realtime['p99_e2e_ms']:.0f} ms",
                f"attainment {realtime['attainment']:.4f}; background {background['output_tokens_per_s']:.0f}",
                f"tokens/s, refused {background['rejected']}; normal P99 TTFT {rows['normal']['p99_ttft_ms']:.0f} ms",
                flush=True,
            )
