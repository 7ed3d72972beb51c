"""The process table, from /proc: what tests that kill processes check is gone."""

from __future__ import annotations

import contextlib
from pathlib import Path


def processes() -> dict[int, tuple[int, int, str]]:
    """Every live process: pid → (parent pid, process group, command line); zombies left out."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
            if fields[0] != "Z":
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found[int(entry.name)] = (int(fields[1]), int(fields[2]), command.strip())
    return found


def descendants(pid: int) -> dict[int, tuple[int, int, str]]:
    """The live processes below ``pid``: its children, theirs, and so on."""
    table = processes()
    below: dict[int, tuple[int, int, str]] = {}
    parents = {pid}
    while parents:
        children = {child: row for child, row in table.items() if row[0] in parents and child not in below}
        below |= children
        parents = set(children)
    return below
