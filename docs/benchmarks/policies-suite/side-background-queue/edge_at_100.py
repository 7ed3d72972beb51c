"""Side run (SIMULATOR arithmetic, no simulation): how close to the physical floor the two 100% targets
that meet on background push the realtime tail, on every workload where background at 100% is missed.

At 100% of fifo's capacity, serving all the offered work sets the mean step (``bench.simrun.mean_step_us``)
and with it the realtime floor. Background is the one tier a policy may serve less of; every background
output token it does not serve takes its share of a prompt and its decode out of every second's work, so
the floor falls. This prints, per workload and suite seed: the floor with all the work served; the floor
with background served at 0.95x vllm-priority's (the target) and the realtime P99 E2E the other two 100%
targets allow (the E2E SLO, for attainment >= 99%, and 0.90x vllm-priority's P99 E2E), as a ratio to that
floor; and tailcut's own P99 E2E against the floor of the background it served. From the repository root:

    .venv/bin/python docs/benchmarks/policies-suite/side-background-queue/edge_at_100.py
"""

import json
from pathlib import Path

from bench.simrun import floor_at_step_ms, floor_e2e_ms, mean_step_us
from bench.workloads import Workload, workload_and_cost
from workers.engines.costmodel import CostModel

SUITE = Path(__file__).parents[2] / "policies-suite-360s-capacity-30k"
WORKLOADS = ("seed-mix", "bursty", "long-history")
SEEDS = (0, 1, 2)
LOAD = 1.0
TARGET = 0.95


def floor_ms(workload: Workload, cost: CostModel, rate_rps: float, unserved_tokens_per_s: float) -> float:
    """The realtime floor (``bench.simrun.floor_e2e_ms``) at ``rate_rps`` with ``unserved_tokens_per_s``
    of background output, and each one's decode and share of its prompt, taken out of the offered work."""
    background = workload.mix("background")
    per_token_us = (
        cost.prefill_token_us * background.mean_uncached_prompt_tokens
        + cost.decode_seq_us * background.mean_output_tokens
    ) / background.mean_output_tokens
    load = 1 - cost.base_us / mean_step_us(workload, cost, rate_rps)
    step_us = cost.base_us / (1 - load + max(0.0, unserved_tokens_per_s) * per_token_us / 1e6)
    return floor_at_step_ms(workload.mix("realtime"), cost, step_us)


def main() -> None:
    for name in WORKLOADS:
        workload, cost = workload_and_cost(name, "h100-llama3-8b")
        background = workload.mix("background")
        slo_ms = workload.mix("realtime").slo.e2e_ms or float("inf")
        for seed in SEEDS:
            folder = SUITE / f"seed{seed}"
            entries = json.loads((folder / "suite.json").read_text())["workloads"]
            rate_rps = LOAD * next(entry["capacity_rps"] for entry in entries if entry["name"] == name)
            rows = {
                (r["policy"], r["tier"]): r
                for r in json.loads((folder / name / "results.json").read_text())["runs"]
                if r["load"] == LOAD
            }
            offered = rate_rps * background.share * background.mean_output_tokens
            full = floor_e2e_ms(workload, cost, rate_rps, "realtime")
            theirs = rows["vllm-priority", "background"]["output_tokens_per_s"]
            at_target = floor_ms(workload, cost, rate_rps, offered - TARGET * theirs)
            allowed = min(slo_ms, 0.90 * rows["vllm-priority", "realtime"]["p99_e2e_ms"])
            tail = rows["tailcut", "realtime"]["p99_e2e_ms"]
            served = rows["tailcut", "background"]["output_tokens_per_s"]
            own = floor_ms(workload, cost, rate_rps, offered - served)
            print(
                f"{name} seed {seed}: floor {full:.0f} ms with all the work ({offered:.0f} background tokens/s",
                f"offered, vllm-priority serves {theirs:.0f}); at {TARGET}x vllm-priority's background",
                f"{at_target:.0f} ms, the 100% targets allow {allowed:.0f} ms = {allowed / at_target:.3f}x it;",
                f"tailcut serves {served / theirs:.3f}x with P99 E2E {tail:.0f} ms = {tail / own:.3f}x its floor",
                f"({own:.0f} ms)",
            )


if __name__ == "__main__":
    main()
