"""CPU time from ``/proc`` (Linux): of one process, of a process group, of the whole machine.

The live benchmarks read these before and after each measured stretch, so their reports say which
process used the cores, and whether something outside the benchmark took some (then its figures are
not tailcut's alone).
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MACHINE = "machine"  # the key of the whole machine's busy CPU seconds in a snapshot
BUSY_MACHINE_SHARE = 0.3  # CPU outside the benchmark above this share of a core: the figures are suspect
YARDSTICK_ITERATIONS = 2_000_000


def _stat_cpu_seconds(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads) from ``/proc``; None elsewhere."""
    try:
        return _stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, IndexError, ValueError):
        return None


def self_cpu_seconds() -> float:
    """User + system CPU seconds of this process."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True, slots=True)
class MachineCpu:
    """CPU seconds of the whole machine so far, all cores: busy, in all, and how long some runnable task
    waited for a core (pressure stall information; 0 without it)."""

    busy_s: float
    total_s: float
    waited_s: float


def machine_cpu() -> MachineCpu | None:
    """The whole machine's CPU so far (``/proc/stat``, ``/proc/pressure/cpu``); None where unreadable."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:9]]
        user, nice, system, idle, iowait, irq, softirq, steal = fields
    except (OSError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq + steal  # guest time is counted in user
    waited_s = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        some = Path("/proc/pressure/cpu").read_text().split("\n", 1)[0]
        waited_s = int(some.rsplit("total=", 1)[1]) / 1e6
    return MachineCpu(busy / ticks, (busy + idle + iowait) / ticks, waited_s)


def machine_busy_seconds() -> float | None:
    """CPU seconds the whole machine spent busy (all cores, every process) from ``/proc/stat``."""
    machine = machine_cpu()
    return None if machine is None else machine.busy_s


def cpu_snapshot(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds of each named process, and of the whole machine under ``MACHINE``."""
    snapshot = {}
    for name, pid in pids.items():
        seconds = cpu_seconds(pid)
        if seconds is not None:
            snapshot[name] = seconds
    busy = machine_busy_seconds()
    if busy is not None:
        snapshot[MACHINE] = busy
    return snapshot


def group_cpu_seconds(pgids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds of every process in each named process group (a child started in its own session and
    the helpers it started, such as vLLM's engine process), from one scan of ``/proc``."""
    wanted = {pgid: name for name, pgid in pgids.items()}
    totals = dict.fromkeys(pgids, 0.0)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended meanwhile
            continue
        name = wanted.get(int(stat.rsplit(")", 1)[1].split()[2]))  # pgrp
        if name is not None:
            totals[name] += _stat_cpu_seconds(stat)
    return totals


def cpu_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in before if name in after}


def interpreter_ns_per_iteration(iterations: int = YARDSTICK_ITERATIONS, *, runs: int = 3) -> float:
    """Nanoseconds one iteration of a plain Python loop of additions takes here, the best of ``runs``: a
    yardstick for runs made on different machines. tailcut's own work is interpreted Python while a
    canned server's is mostly the kernel's socket calls, so a machine with a slow interpreter moves the
    ratios between the two (BENCHMARKS.md "The same code on a slower machine")."""
    if iterations < 1 or runs < 1:
        raise ValueError(f"iterations and runs must be at least 1: {iterations}, {runs}")
    best = math.inf
    for _ in range(runs):
        started = time.perf_counter_ns()
        total = 0
        for value in range(iterations):
            total += value
        best = min(best, time.perf_counter_ns() - started)
    return best / iterations
