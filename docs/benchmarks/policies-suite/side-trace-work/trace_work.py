"""Side run (SIMULATOR arithmetic, no simulation): the work each suite trace offers against the work its
workload offers on average, and the realtime tail against the floor of either.

The physical floor (``bench.simrun.floor_e2e_ms``) takes the mean step the offered load requires from
the workload's mean request (each session's previous prompt in the prefix cache). One 360-second trace
offers a little more or less than that mean, and a chat already under way when the window opens sends
its history uncached. This prints, for every shipped workload and the suite's seeds 0-2 at 90%: the mean
step the trace's own work requires (the same Little's-law formula on the trace's requests, a turn whose
previous turn is in the trace computing only what it adds to it), the floor at that step, and tailcut's
committed realtime P99 E2E against both floors; then the load of long-history's traces per 30 seconds.
From the repository root:

    .venv/bin/python docs/benchmarks/policies-suite/side-trace-work/trace_work.py
"""

import json
from pathlib import Path

from bench.simrun import floor_at_step_ms, floor_e2e_ms, mean_step_us
from bench.workloads import Arrival, make_trace, workload_and_cost
from workers.engines.costmodel import CostModel

SUITE = Path(__file__).parents[2] / "policies-suite-360s-capacity-30k"
WORKLOADS = ("seed-mix", "bursty", "sharegpt-chat", "long-history")
SEEDS = (0, 1, 2)
LOAD = 0.9
DURATION_S = 360
BIN_S = 30


def work_us(arrival: Arrival, previous: Arrival | None, cost: CostModel) -> float:
    """Engine time the request adds to the steps it runs in, beyond their base: the prompt tokens it
    computes (less its previous turn's prompt, when that turn is in the trace and so in the cache) and
    one decode per output token."""
    computed = arrival.prompt_tokens - (previous.prompt_tokens if previous is not None else 0)
    return cost.prefill_token_us * computed + cost.decode_seq_us * arrival.output_tokens


def main() -> None:
    for name in WORKLOADS:
        workload, cost = workload_and_cost(name, "h100-llama3-8b")
        mix = workload.mix("realtime")
        for seed in SEEDS:
            folder = SUITE / f"seed{seed}"
            entries = json.loads((folder / "suite.json").read_text())["workloads"]
            rate_rps = LOAD * next(entry["capacity_rps"] for entry in entries if entry["name"] == name)
            rows = json.loads((folder / name / "results.json").read_text())["runs"]
            ours = next(r for r in rows if (r["policy"], r["load"], r["tier"]) == ("tailcut", LOAD, "realtime"))
            trace = make_trace(workload, rate_rps, seed=seed, duration_s=DURATION_S)
            by_index = {arrival.index: arrival for arrival in trace}
            works = [
                work_us(arrival, by_index.get(arrival.previous) if arrival.previous is not None else None, cost)
                for arrival in trace
            ]
            load = sum(works) / (DURATION_S * 1e6)
            step_us = cost.base_us / (1 - load)
            floor_ms = floor_at_step_ms(mix, cost, step_us)
            mean_floor_ms = floor_e2e_ms(workload, cost, rate_rps, "realtime")
            mean_us, tail_ms = mean_step_us(workload, cost, rate_rps), ours["p99_e2e_ms"]
            print(
                f"{name} seed {seed}: mean step {mean_us / 1000:.2f} ms (workload)",
                f"{step_us / 1000:.2f} ms (trace, {step_us / mean_us - 1:+.1%});",
                f"floor {mean_floor_ms:.1f} / {floor_ms:.1f} ms; tailcut's realtime P99 E2E {tail_ms:.1f} ms",
                f"= {tail_ms / mean_floor_ms:.3f} / {tail_ms / floor_ms:.3f}x",
            )
            if name == "long-history":
                bins = [0.0] * (DURATION_S // BIN_S)
                for arrival, work in zip(trace, works, strict=True):
                    bins[int(arrival.at_s // BIN_S)] += work
                cold = sum(1 for a in trace if a.previous is None and a.history_tokens)
                print(
                    f"  {cold} turns of chats under way when the window opens (history uncached); load per {BIN_S} s:",
                    " ".join(f"{work / (BIN_S * 1e6):.3f}" for work in bins),
                )


if __name__ == "__main__":
    main()
