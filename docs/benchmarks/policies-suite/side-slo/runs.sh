#!/bin/sh
# Side runs of issue 12 (SIMULATOR): a size learned against a configured realtime E2E objective.
cd "$(dirname "$0")/../../../.."
S=docs/benchmarks/policies-suite-360s-capacity-30k/seed0/suite.json
run() { echo "\$ $*"; env "$@" 2>&1 | grep -v "^\s*$" | tail -n 20; echo; }
B="fluid=0.3+fo+fh=-1+fx+slp=0.99+slc+sl0=600+sll=0.5"
run SIDE_SUITE=$S SIDE_WORKLOADS=seed-mix .venv/bin/python docs/benchmarks/policies-suite/side_runs.py grid shipped slo=1000 slo=1000+slg=0 slo=900 slo=1000+slp=0.99+slq=0.02
run SIDE_SUITE=$S SIDE_WORKLOADS=seed-mix .venv/bin/python docs/benchmarks/policies-suite/side-fluid/fluid.py ow=176+fluid=0.3+fo+fh=800+fx ow=176+fluid=0.3+fo+fh=1000+fx ow=176+$B+slo=1000+slq=0.02 ow=176+$B+slo=1000+slq=0.2 ow=176+$B+slo=1000+slq=0.5
run SIDE_SUITE=$S SIDE_WORKLOADS=long-history .venv/bin/python docs/benchmarks/policies-suite/side-fluid/fluid.py ow=176+$B+slo=1500+slq=0.5 ow=176+$B+slo=1000+slq=0.5
# Steps of one time at C = 650 throughout, the learned size past 32 background requests waiting.
T="ow=32+ft=650+fh=-1+fx+slp=0.99+slc+sl0=600+sll=0.5+slg=32+slo=1000"
run SIDE_SUITE=$S SIDE_WORKLOADS=seed-mix .venv/bin/python docs/benchmarks/policies-suite/side-fluid/fluid.py ow=32+ft=650+fh=800+fx $T+slq=0.2 $T+slq=0.5
# The same without the realtime gate and the slow-step rule, as side-fluid/runs.txt ran C = 650 / 800.
run SIDE_SUITE=$S SIDE_WORKLOADS=seed-mix .venv/bin/python docs/benchmarks/policies-suite/side-fluid/fluid.py $T+gm=1000+sm=0+slq=0.3 $T+gm=1000+sm=0+slq=0.5 $T+gm=1000+sm=0+slq=0.7
run SIDE_SUITE=$S SIDE_WORKLOADS=seed-mix .venv/bin/python docs/benchmarks/policies-suite/side-fluid/fluid.py $T+gm=1000+sm=0+slq=0.55 $T+gm=1000+sm=0+slq=0.6
# q = 0.55 on the four workloads (every target in checks.jsonl), and on seed-mix's other two traces.
run SIDE_SUITE=$S SIDE_CHECKS_OUT=docs/benchmarks/policies-suite/side-slo/checks.jsonl .venv/bin/python docs/benchmarks/policies-suite/side-fluid/fluid.py $T+gm=1000+sm=0+slq=0.55
for seed in 1 2; do
  run SIDE_SUITE=docs/benchmarks/policies-suite-360s-capacity-30k/seed$seed/suite.json SIDE_WORKLOADS=seed-mix .venv/bin/python docs/benchmarks/policies-suite/side-fluid/fluid.py shipped $T+gm=1000+sm=0+slq=0.55
done
