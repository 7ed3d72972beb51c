"""Where a benchmark's per-request records go: ``OUT/NAME-records.jsonl``, one JSON object per line.

The summary JSON beside it (``NAME.json``) holds what the tables and BENCHMARKS.md quote; the raw records
can be large (every request of every level or policy) and stay in the ``--out`` folder: ``.gitignore``
keeps them out of ``docs/benchmarks/``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from bench.stats import RequestRecord

SUFFIX = "-records.jsonl"


def records_path(out: Path, name: str) -> Path:
    return out / f"{name}{SUFFIX}"


def record_row(record: RequestRecord, **keys: Any) -> dict[str, Any]:
    """One record as a row, after ``keys`` that say where it belongs (system, policy, level, ...)."""
    return {**keys, **asdict(record)}


def write_records(out: Path, name: str, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``rows`` to ``out/NAME-records.jsonl``; its path."""
    path = records_path(out, name)
    with path.open("wb") as file:
        for row in rows:
            file.write(orjson.dumps(row) + b"\n")
    return path


def read_records(path: Path) -> list[dict[str, Any]]:
    """The rows of a records file."""
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line]
