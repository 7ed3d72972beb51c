"""CPU, wake-ups and Redis commands of an idle tailcut stack (a private redis-server, the API and one
worker on the zero-cost ``null`` engine), over 30 s after 5 s of settling.

Run from the root of the tree to measure (its ``tailcut`` is the one the child processes import):
``.venv/bin/python docs/benchmarks/idle/idle_cost.py``. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, os.getcwd())

from bench.stack import tailcut_stack
from tailcut.models import prepare_tiny
from tailcut.settings import CommonSettings

WINDOW_S = 30.0


def usage(pid: int) -> tuple[int, int]:
    """CPU ticks and context switches (all threads) of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    switches = 0
    for thread in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{thread}/status").read_text().splitlines():
            if "ctxt_switches" in line:
                switches += int(line.split()[1])
    return int(fields[11]) + int(fields[12]), switches


def main() -> None:
    model = prepare_tiny(CommonSettings().cache_dir, progress=print)
    with tempfile.TemporaryDirectory() as logs:
        worker_env = {"TAILCUT_ENGINE__KIND": "null"}
        with tailcut_stack(model, Path(logs), env={}, worker_env=worker_env) as stack:
            time.sleep(5)
            client = redis.Redis.from_url(stack.redis_url)
            commands = int(client.info("stats")["total_commands_processed"])
            before = {name: usage(pid) for name, pid in stack.pids.items()}
            time.sleep(WINDOW_S)
            after = {name: usage(pid) for name, pid in stack.pids.items()}
            commands = int(client.info("stats")["total_commands_processed"]) - commands - 1
            ticks = os.sysconf("SC_CLK_TCK")
            print(f"redis commands {commands / WINDOW_S:.1f}/s")
            for name, (cpu, switches) in before.items():
                cpu_ms = (after[name][0] - cpu) * 1000 / ticks / WINDOW_S
                print(f"{name:8s} cpu {cpu_ms:6.1f} ms/s  switches {(after[name][1] - switches) / WINDOW_S:6.1f}/s")


if __name__ == "__main__":
    main()
