"""Print summary.txt from the runs in this folder (run from it): the one-stream rounds, the full runs and the
high-load rounds of the three trees."""

import glob
import json
import statistics
from typing import Any

TREES = {"a": "283ca58 (before)", "b": "d0cb600 (token drawn at intake)", "c": "6e48cd6 (and the read deferral)"}


def load(path: str) -> Any:
    with open(path) as file:
        return json.load(file)


def level(run: Any, streams: int, key: str = "levels") -> Any:
    return next(item for item in run[key] if item["streams"] == streams and item["client"] == "raw")


def rate(item: Any) -> float:
    return float(item["steady_tokens_per_s"])


def per_chunk(item: Any) -> float:
    return float(item["num_tokens"] / item["num_chunks"])


print("One stream, --streams 1 --requests-per-level 3000, four rounds (order a b c, then c b a):")
print("P50 TTFT above the canned server's (ms); in brackets the worker's and the API's CPU per token (us)")
ttft: dict[str, list[float]] = {tree: [] for tree in TREES}
for round_ in range(1, 5):
    row = []
    for tree in TREES:
        run = load(f"r{round_}-{tree}/overhead.json")
        cpu = level(run, 1)["cpu_us_per_token"]
        ttft[tree].append(run["targets"][0]["value"])
        row.append(f"{tree}: {ttft[tree][-1]:.3f} ({cpu['worker']:.1f} / {cpu['api']:.1f})")
    print(f"round {round_}: " + "   ".join(row))
for tree, name in TREES.items():
    values = ttft[tree]
    print(f"{name}: median {statistics.median(values):.3f} ms, range {min(values):.3f}-{max(values):.3f}")
print()
print("Full runs, --streams 1,200,1000 --requests-per-level 12000 (order: after, before, before, after):")
for name in ("after-1", "before-1", "before-2", "after-2"):
    run = load(f"full/{name}/overhead.json")
    two, thousand = level(run, 200), level(run, 1000)
    canned_two, canned_thousand = level(run, 200, "client_ceilings"), level(run, 1000, "client_ceilings")
    cpu = two["cpu_us_per_token"]
    print(
        f"{name}: TTFT +{run['targets'][0]['value']:.2f} ms at 1 stream; 200 streams {rate(two):,.0f} tokens/s "
        f"({rate(two) / rate(canned_two):.2f}x the canned {rate(canned_two):,.0f}), {per_chunk(two):.1f} tokens/chunk, "
        f"API {cpu['api']:.1f} / worker {cpu['worker']:.1f} us per token; "
        f"1,000 streams {rate(thousand):,.0f} ({rate(thousand) / rate(canned_thousand):.2f}x)"
    )
print()
print("High load, --streams 200,1000 --requests-per-level 12000 --no-client-ceiling, two rounds (order a b c):")
for round_ in (1, 2):
    for tree in TREES:
        run = load(f"high-load/r{round_}-{tree}/overhead.json")
        two, thousand = level(run, 200), level(run, 1000)
        print(
            f"round {round_} {tree}: 200 streams {rate(two):,.0f} tokens/s, {per_chunk(two):.1f} tokens/chunk; "
            f"1,000 streams {rate(thousand):,.0f}, {per_chunk(thousand):.1f} tokens/chunk"
        )
runs = glob.glob("**/overhead.json", recursive=True)
loops = sorted(round(load(path)["machine"]["python_loop_ns"], 1) for path in runs)
print(f"machine.python_loop_ns over the runs: {loops[0]}-{loops[-1]}")
