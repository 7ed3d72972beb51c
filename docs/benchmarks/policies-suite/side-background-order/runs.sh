#!/bin/sh
# Side runs of issue 12 (SIMULATOR): which background request goes first, and which is refused, past
# what the worker serves. Seed 0's 360-second traces; every line in runs.txt.
cd "$(dirname "$0")/../../../.."
S=docs/benchmarks/policies-suite-360s-capacity-30k/seed0/suite.json
run() { echo "\$ $*"; env "$@" 2>&1 | grep -v "^\s*$" | tail -n 20; echo; }
SIDE=docs/benchmarks/policies-suite/side_runs.py
FLUID=docs/benchmarks/policies-suite/side-fluid/fluid.py
# The order within background: shortest prompt first (bgsp; bgsq: the backlog counted as that order
# drains it), least engine time per expected output token first (bgpo); the cut-in rule off (ci=1000).
run SIDE_SUITE=$S SIDE_WORKLOADS=seed-mix .venv/bin/python $SIDE grid shipped bgsp bgsq bgpo ci=1000 bgsp+ci=1000
# The same orders past what the worker serves (the option at 176: its fixed room, or only the chunk).
run SIDE_SUITE=$S SIDE_WORKLOADS=seed-mix .venv/bin/python $SIDE grid ow=176 bgsp+ow=176 bgpo+ow=176 ow=176+owm bgsp+ow=176+owm bgsq+ow=176+owm bgpo+ow=176+owm
# Refusing the costliest prompts first near the bound: past a share of it, a prompt longer than the
# median of the last 1,000 background prompts is refused.
run SIDE_SUITE=$S SIDE_WORKLOADS=seed-mix .venv/bin/python $SIDE grid scf=0.5 scf=0.75 scf=0.75+ow=176
# Under steps of one time (C = 750, side-fluid), where the background's engine time is fixed.
F="ft=750+fx+gm=1000+sm=0"
run SIDE_SUITE=$S SIDE_WORKLOADS=seed-mix .venv/bin/python $FLUID $F $F+bgsp $F+bgpo $F+scf=0.9
# The two orders on the four workloads (every target in checks.jsonl).
run SIDE_SUITE=$S SIDE_CHECKS_OUT=docs/benchmarks/policies-suite/side-background-order/checks.jsonl .venv/bin/python $SIDE grid bgsp bgpo
# Where shortest-first's background comes from: the room and prompts in prefill at 100%.
run SIDE_SUITE=$S .venv/bin/python $SIDE rows seed-mix shipped 1.0
run SIDE_SUITE=$S .venv/bin/python $SIDE rows seed-mix bgsp 1.0
# Steps of one time at C = 750 with bgpo, the variant that meets seed-mix's 14, on the four workloads.
run SIDE_SUITE=$S SIDE_CHECKS_OUT=docs/benchmarks/policies-suite/side-background-order/checks-ft750-bgpo.jsonl .venv/bin/python $FLUID $F+bgpo
