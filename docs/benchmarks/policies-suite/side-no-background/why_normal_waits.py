"""What holds the normal tier back on a mix without background (SIMULATOR; a side run of issue 12).

Runs one ``side_runs.py grid`` variant of a workload at one load, and after every scheduling round in
which a normal request is still waiting counts the limit that holds it: no free engine slot, not enough
KV for its reservation, or the lower tiers' prefill room (then the decodes, the chunks in flight and the
limit are averaged). From the repository root:

    SIDE_SUITE=docs/benchmarks/policies-suite-360s-capacity-30k/seed0/suite.json \
      .venv/bin/python docs/benchmarks/policies-suite/side-no-background/why_normal_waits.py \
      docs/benchmarks/policies-suite/side-no-background/no-background.json 215.7695814440749 shipped 0.9
"""

import sys
from pathlib import Path
from typing import Any

from bench import policies
from bench.workloads import workload_and_cost

sys.path.insert(0, str(Path(__file__).parents[1]))
import side_runs  # type: ignore[import-not-found]


def main(path: str, capacity_rps: float, spec: str, load: float) -> None:
    side_runs.patch_sizes(spec)
    policy = side_runs.schedmod.TailcutPolicy
    schedule = policy.schedule
    held = {"rounds": 0, "slots": 0, "kv": 0, "room": 0}
    sums = {"decodes": 0.0, "in flight": 0.0, "limit": 0.0}

    def scheduling(self: Any, view: Any, now_ms: int) -> Any:
        decision = schedule(self, view, now_ms)
        head = next(self._normal(), None)
        if head is None or not self.adapting:
            return decision
        held["rounds"] += 1
        if view.free_slots - len(decision.admit) <= 0:
            held["slots"] += 1
        elif head.reserved_kv_tokens(self.config) > view.free_kv_tokens:
            held["kv"] += 1
        else:
            held["room"] += 1
            room = self.room(view, now_ms)
            sums["decodes"] += room.decodes
            chunks = sum(self._chunk(tokens, room) for tokens, _ in self._prefilling.values())
            sums["in flight"] += room.decodes + chunks
            sums["limit"] += room.lower_limit
        return decision

    policy.schedule = scheduling
    workload, cost = workload_and_cost(path, "h100-llama3-8b")
    variant, seed, duration_s = side_runs.grid_variant(spec), side_runs.SEED, side_runs.DURATION_S
    job = policies.Job(variant, load, load * capacity_rps, seed, duration_s, workload, cost)
    for row in policies.run_job(job).rows:
        print(f"{row['tier']}: P99 TTFT {row['p99_ttft_ms']:.0f} ms, P99 queue wait {row['p99_queue_wait_ms']:.0f} ms")
    by_room = held["room"] or 1
    print(
        f"{spec} {load}: rounds ending with a normal request waiting {held['rounds']}; held by slots {held['slots']},"
        f" by KV {held['kv']}, by the room {held['room']} (then on average: decodes {sums['decodes'] / by_room:.0f},"
        f" decodes and chunks in flight {sums['in flight'] / by_room:.0f}, limit {sums['limit'] / by_room:.0f} tokens)"
    )


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
