"""SIMULATOR: the steps a ``SimEngine`` ran, one JSON line each, to lay a live run beside its virtual twin.

``tailcut bench live`` runs one trace on the virtual clock and through the live pipeline; where their
latencies differ, what the engine did step by step says why. Both sides write the same lines: an
``add`` line when a request enters the engine (its prompt length and priority, the virtual time), a
``step`` line per step that ran — its virtual start and duration, the token budget and prefill chunk
in force, prefill tokens and decoding requests, the prefill tokens each request computed, the
requests admitted (with their prefix-cache hits) and those that sampled their first token. Decoding
requests are counted, not listed, so a line stays small at hundreds of running requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import orjson

from workers.engines.sim import SimEngine, StepResult


class StepLog:
    """Writes a ``SimEngine``'s added requests and steps to ``path`` (truncated on open)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = path.open("wb")
        self._started: set[str] = set()  # requests that sampled a token since they were added

    def added(self, sim: SimEngine, request_id: str, num_prompt_tokens: int, priority: int) -> None:
        self._started.discard(request_id)
        self._write({"add": request_id, "at_ms": sim.now_us / 1000, "prompt": num_prompt_tokens, "priority": priority})

    def stepped(self, sim: SimEngine, step: StepResult) -> None:
        first = [request_id for request_id in step.new_token_ids if request_id not in self._started]
        self._started.update(first)
        self._started.difference_update(step.finished)
        self._write(
            {
                "step_ms": step.start_us / 1000,
                "ms": step.duration_us / 1000,
                "budget": sim.token_budget,
                "chunk": sim.long_prefill_token_threshold,
                "prefill": step.num_prefill_tokens,
                "decode": step.num_decode_seqs,
                "prefilling": {
                    request_id: num_tokens
                    for request_id, num_tokens in step.scheduled_tokens.items()
                    if num_tokens > 1 or request_id in step.num_cached_tokens
                },
                "admitted": step.num_cached_tokens,
                "first": first,
                "waiting": sim.num_waiting,
                "running": sim.num_running,
            }
        )

    def close(self) -> None:
        self._file.close()

    def _write(self, line: dict[str, object]) -> None:
        self._file.write(orjson.dumps(line) + b"\n")
