#!/bin/bash
# One run of BENCHMARKS.md "Periodic work in the engine's wake-ups": `tailcut bench overhead` at one level,
# and the voluntary context switches per second of the API, the worker and the benchmark's private Redis
# over ten seconds in the middle of it (summed over each process's threads, from /proc).
# usage: ctx.sh OUT STREAMS REQUESTS, run from the checkout under test; PYTHON (default .venv/bin/python)
# and EXTRA (default --step-ms 40) may be set.
set -u
out=$1; mkdir -p "$out"
python=${PYTHON:-.venv/bin/python}
"$python" -m tailcut bench overhead --clients raw --streams "$2" --requests-per-level "$3" --no-client-ceiling \
    ${EXTRA:---step-ms 40} --out "$out/run" > "$out/bench.txt" 2>&1 &
bench=$!
for _ in $(seq 1 120); do grep -q "concurrent streams" "$out/bench.txt" 2>/dev/null && break; sleep 0.5; done
sleep 3
api=$(pgrep -f "m tailcut api$" | head -1); worker=$(pgrep -f "m tailcut worker$" | head -1)
redis=$(pgrep -f "redis-server 127.0.0.1" | grep -v "^$(pgrep -o redis-server)$" | tail -1)
switches() {
    for pid in $api $worker $redis; do
        total=0
        for status in /proc/$pid/task/*/status; do
            total=$((total + $(awk '/^voluntary_ctxt/{print $2}' "$status")))
        done
        echo -n "$total "
    done
}
before=$(switches); sleep 10; after=$(switches)
{
    echo "api worker redis pids: $api $worker $redis"
    echo "before $before"; echo "after $after"
    python3 -c "
a = list(map(int, '$before'.split())); b = list(map(int, '$after'.split()))
print('voluntary switches per s (api worker redis):', [(y - x) / 10 for x, y in zip(a, b)])"
} > "$out/ctx.txt"
wait $bench
cat "$out/ctx.txt"
