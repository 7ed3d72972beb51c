#!/usr/bin/env bash
# Profile the API and the worker at 200 streams of the null engine (raw client): py-spy records both
# processes for 10 s in the middle of a `tailcut bench overhead` run; summary.py turns each raw file
# into shares of its samples. Run from the repository root: docs/benchmarks/.../profile/profile.sh
# (py-spy is not a dependency of the project: `.venv/bin/pip install py-spy` first).
set -euo pipefail
here=$(dirname "$0")
.venv/bin/tailcut bench overhead --clients raw --streams 200 --requests-per-level 60000 \
    --no-client-ceiling --out /tmp/profile-run > "$here/bench.txt" 2>&1 &
bench=$!
pid_of() { pgrep -f -n "m tailcut $1\$" || pgrep -f -n "tailcut $1\$"; }
for _ in $(seq 60); do
    api=$(pid_of api || true); worker=$(pid_of worker || true)
    [[ -n "$api" && -n "$worker" ]] && break
    sleep 1
done
sleep 8  # past the stack's start and the level's ramp
.venv/bin/py-spy record -r 200 -d 10 -f raw --nonblocking -p "$api" -o "$here/api.raw" > /dev/null &
spy=$!
.venv/bin/py-spy record -r 200 -d 10 -f raw --nonblocking -p "$worker" -o "$here/worker.raw" > /dev/null
wait "$spy"
wait "$bench"
.venv/bin/python "$here/summary.py" "$here/api.raw" > "$here/profile-api.txt"
.venv/bin/python "$here/summary.py" "$here/worker.raw" > "$here/profile-worker.txt"
