#!/bin/bash
# One run of BENCHMARKS.md "Periodic work in the engine's wake-ups", real engine: the tailcut side of
# `tailcut bench vs-vllm` (one round, c=16), wake-ups (voluntary context switches, all threads) and CPU of the
# API, the worker and Redis over 20 s from 8 s into the c=16 phase, from /proc.
# usage: vvctx.sh OUT CHECKOUT (PYTHON: default .venv/bin/python of the checkout)
out=$1; mkdir -p $out; cd $2
${PYTHON:-.venv/bin/python} -m tailcut bench vs-vllm --only tailcut --rounds 1 --requests-cn 256 --requests-c1 5 --out $out/run > $out/bench.txt 2>&1 &
bench=$!
for _ in $(seq 1 600); do grep -q "concurrency 16" $out/bench.txt 2>/dev/null && break; sleep 0.5; done
sleep 8
api=$(pgrep -f "m tailcut api$" | head -1); worker=$(pgrep -f "m tailcut worker$" | head -1)
redis=$(pgrep -f "redis-server 127.0.0.1" | grep -v "^$(pgrep -o redis-server)$" | tail -1)
switches() { for pid in $api $worker $redis; do t=0; for s in /proc/$pid/task/*/status; do t=$((t + $(awk '/^voluntary_ctxt/{print $2}' $s))); done; echo -n "$t "; done; }
cpu() { for pid in $api $worker $redis; do awk '{printf "%d ", $14+$15}' /proc/$pid/stat; done; }
b=$(switches); bc=$(cpu); sleep 20; a=$(switches); ac=$(cpu)
python3 -c "
b=list(map(int,'$b'.split())); a=list(map(int,'$a'.split())); bc=list(map(int,'$bc'.split())); ac=list(map(int,'$ac'.split()))
print('wake-ups per s (api worker redis):', [round((y-x)/20,1) for x,y in zip(b,a)], ' cores:', [round((y-x)/100/20,3) for x,y in zip(bc,ac)])" > $out/ctx.txt
wait $bench
cat $out/ctx.txt; grep -E "│ tailcut │ +1 │ 16" $out/bench.txt
