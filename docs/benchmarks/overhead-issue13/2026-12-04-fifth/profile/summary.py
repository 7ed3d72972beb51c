"""Shares of a py-spy raw profile (``py-spy record -f raw``): by function inclusive, then as leaf.

Usage: python summary.py PROFILE.raw > profile.txt
"""

from __future__ import annotations

import re
import sys
from collections import Counter

FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>[^():]*?)(?::\d+)?\)$")
SHOWN = 40


def short(frame: str) -> str:
    """``function (file)``, the path cut to its last two parts and the line number dropped."""
    match = FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    path = "/".join(match["file"].split("/")[-2:])
    return f"{match['name']} ({path})"


def main(path: str) -> None:
    inclusive: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    total = 0
    for line in open(path, encoding="utf-8"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        frames = [short(frame) for frame in stack.split(";")]
        total += samples
        for frame in set(frames):
            inclusive[frame] += samples
        leaf[frames[-1]] += samples
    print(f"total samples {total}")
    for title, counts in (("inclusive", inclusive), ("leaf", leaf)):
        print(f"--- {title}")
        for frame, samples in counts.most_common(SHOWN):
            print(f"{100 * samples / total:5.1f}% {frame}")


if __name__ == "__main__":
    main(sys.argv[1])
