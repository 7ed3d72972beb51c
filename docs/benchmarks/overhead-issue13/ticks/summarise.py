"""The wake-up runs of BENCHMARKS.md "Periodic work in the engine's wake-ups": one row per run.

Each folder ``{tree}{round}-s{streams}`` holds a run of ``tailcut bench overhead --clients raw --step-ms 40
--streams N`` (``run/overhead.json``, the console as ``bench.txt``) and the voluntary context switches per
second of the API, the worker and Redis over ten seconds in the middle of it (``ctx.txt``, by ``ctx.sh``).
Trees: ``a`` 667c4aa (before), ``b`` 8ba9d20 (the ticks), ``c`` bb4f62d (and the backlog probe in one script).
Run: ``python summarise.py > summary.txt``.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

HERE = Path(__file__).parent
TREES = {"a": "667c4aa (before)", "b": "8ba9d20 (ticks)", "c": "bb4f62d (ticks, backlog in one script)"}


def main() -> None:
    print(
        "run | tree | streams | tokens/s | wake-ups/s api, worker, redis | CPU µs/token api, worker, redis"
        " | worker ÷ api"
    )
    for folder in sorted(HERE.glob("[abc][0-9]-s*")):
        level = json.loads((folder / "run" / "overhead.json").read_text())["levels"][0]
        line = (folder / "ctx.txt").read_text().splitlines()[-1]
        wakes = ast.literal_eval(line.split(":", 1)[1].strip())
        cpu = level["cpu_us_per_token"]
        tree = TREES[folder.name[0]]
        print(
            f"{folder.name} | {tree} | {level['streams']} | {level['steady_tokens_per_s']:,.0f} | "
            f"{wakes[0]:.1f}, {wakes[1]:.1f}, {wakes[2]:.1f} | "
            f"{cpu['api']:.1f}, {cpu['worker']:.1f}, {cpu['redis']:.1f} | {cpu['worker'] / cpu['api']:.2f}"
        )


if __name__ == "__main__":
    main()
