"""Read the per-process mark files of a traced one-stream run (``m.<pid>``: ``<monotonic ns> <step>``
per line) into the median time between consecutive steps of each request's first token."""

import glob
import itertools
import statistics
import sys

ORDER = [
    *("c_send", "a_in", "a_body", "a_valid", "a_respond", "a_admitted", "a_lease", "a_xadd0", "a_xadd1"),
    *("w_read", "w_fenced", "w_accept", "w_sched", "w_decided", "w_serve", "w_step", "w_emit1"),
    *("w_write0", "w_write1", "a_sub", "a_yield", "c_first"),
]

marks: list[tuple[int, str]] = []
for path in glob.glob(sys.argv[1] + "/m.*"):
    with open(path) as lines:
        for line in lines:
            at, name = line.split()
            marks.append((int(at), name))
marks.sort()

requests: list[dict[str, int]] = []
current: dict[str, int] | None = None
for at, name in marks:
    if name == "c_send":
        current = {"c_send": at}
        requests.append(current)
        continue
    if current is None or name in current:
        continue  # each step's first occurrence only
    if name == "w_sched" and "w_fenced" not in current:
        continue  # a scheduling tick before this request was read
    if all(step in current for step in ORDER[1 : ORDER.index(name)] if step != "w_sched"):
        current[name] = at
full = [request for request in requests if all(step in request for step in ORDER)]
print(len(requests), "requests,", len(full), "with the full chain")
for before, after in itertools.pairwise(ORDER):
    gaps = sorted((request[after] - request[before]) / 1000 for request in full)
    p90 = gaps[int(0.9 * len(gaps))]
    print(f"{before:>10} -> {after:<10} median {statistics.median(gaps):7.1f} µs  p90 {p90:7.1f}")
total = [(request["c_first"] - request["c_send"]) / 1000 for request in full]
print("total median", statistics.median(total))
