"""Open- and closed-loop load against an OpenAI-compatible server, bounded by a wall-clock limit.

Open loop (WORKLOADS.md's default): each request of a Poisson trace is sent at its offset whatever
happened to the requests before it, so the server's queueing shows up in latency. Closed loop (like
``ab -c``): C workers each send their next request when the previous one finished, so the offered load
adapts to the server and hides its queueing; it is for throughput and pipeline-overhead measurements.
At the time limit, requests still running are abandoned and requests not yet sent are recorded without
being sent, both as ``error: timeout``: every request of the trace has a record.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.client import Timeline, open_http, send
from bench.stats import RequestRecord
from bench.workloads import Arrival, Workload, draw_requests

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class LoadResult:
    records: list[RequestRecord]  # one per request, in index order
    duration_s: float  # start → last request finished (or the time limit): the denominator of rates
    prompt_salt: int  # made the prompts of this run distinct from other runs' (bench.client.prompt_token_ids)


def closed_loop_requests(workload: Workload, count: int, *, seed: int) -> list[Arrival]:
    """The requests ``poisson_trace`` would draw with this seed (same tiers and lengths), all at offset 0."""
    return draw_requests(workload, count, np.random.default_rng([seed, 2]))


async def run_open_loop(
    base_url: str,
    model: str,
    trace: Sequence[Arrival],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    prompt_salt: int | None = None,
    show_progress: bool = False,
) -> LoadResult:
    """Send each request of ``trace`` at its ``at_s`` offset from the start, regardless of completions."""
    salt = secrets.randbits(32) if prompt_salt is None else prompt_salt
    async with open_http(base_url) as http:
        with _Progress(len(trace), show_progress) as progress:
            origin_s = time.perf_counter()
            deadline_s = origin_s + timeout_s
            tasks: list[asyncio.Task[RequestRecord]] = []
            unsent: list[RequestRecord] = []
            for arrival in trace:
                send_at_s = origin_s + arrival.at_s
                if send_at_s >= deadline_s:
                    unsent.append(_not_sent(arrival, origin_s, sent_s=send_at_s))
                    continue
                await asyncio.sleep(max(0.0, send_at_s - time.perf_counter()))
                progress.on_sent()
                request = send(http, model, arrival, origin_s=origin_s, deadline_s=deadline_s, salt=salt)
                tasks.append(asyncio.create_task(progress.track(request)))
            records = [*await asyncio.gather(*tasks), *unsent]
            duration_s = time.perf_counter() - origin_s
    return LoadResult(sorted(records, key=lambda record: record.index), duration_s, salt)


async def run_closed_loop(
    base_url: str,
    model: str,
    requests: Sequence[Arrival],
    *,
    concurrency: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    prompt_salt: int | None = None,
    show_progress: bool = False,
) -> LoadResult:
    """``concurrency`` workers share ``requests`` in order; each sends its next when its previous finished."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    salt = secrets.randbits(32) if prompt_salt is None else prompt_salt
    pending: Iterator[Arrival] = iter(requests)  # shared: each worker takes the next request
    async with open_http(base_url) as http:
        with _Progress(len(requests), show_progress) as progress:
            origin_s = time.perf_counter()
            deadline_s = origin_s + timeout_s

            async def worker() -> list[RequestRecord]:
                records = []
                for arrival in pending:
                    now_s = time.perf_counter()
                    if now_s >= deadline_s:
                        records.append(_not_sent(arrival, origin_s, sent_s=now_s))
                        continue
                    progress.on_sent()
                    request = send(http, model, arrival, origin_s=origin_s, deadline_s=deadline_s, salt=salt)
                    records.append(await progress.track(request))
                return records

            per_worker = await asyncio.gather(*(worker() for _ in range(concurrency)))
            duration_s = time.perf_counter() - origin_s
    records = [record for records in per_worker for record in records]
    return LoadResult(sorted(records, key=lambda record: record.index), duration_s, salt)


def _not_sent(arrival: Arrival, origin_s: float, *, sent_s: float) -> RequestRecord:
    return Timeline(sent_s).record(arrival, origin_s=origin_s, status="error", error="timeout (not sent)")


class _Progress:
    """The live line: sent / completed / in flight / errors (on stderr; nothing when not shown)."""

    def __init__(self, total: int, show: bool) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not show,
        )
        self._task = self._progress.add_task("", total=total)
        self.sent = self.completed = self.rejected = self.errors = 0
        self._refresh()

    def __enter__(self) -> _Progress:
        self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._progress.stop()

    def on_sent(self) -> None:
        self.sent += 1
        self._refresh()

    async def track(self, request: Awaitable[RequestRecord]) -> RequestRecord:
        record = await request
        self.completed += 1
        self.rejected += record.status == "rejected"
        self.errors += record.status == "error"
        self._refresh()
        return record

    def _refresh(self) -> None:
        description = (
            f"sent {self.sent}  completed {self.completed}  in flight {self.sent - self.completed}  "
            f"rejected {self.rejected}  errors {self.errors}"
        )
        self._progress.update(self._task, completed=self.completed, description=description)
