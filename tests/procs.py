"""The process table, from /proc: what tests that kill processes check is gone (``tailcut.processes``)."""

from __future__ import annotations

from tailcut.processes import descendants
from tailcut.processes import process_table as processes

__all__ = ["descendants", "processes"]
