"""A tailcut stack for one benchmark run: a private redis-server, one worker and the API as child processes
(like ``tailcut up``, without the batch-job process), each logging to a file.

Started and stopped with ``tailcut.processes``: every process dies with the benchmark, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tailcut.processes import (
    Child,
    Progress,
    free_port,
    private_redis,
    start_child,
    stop_children,
    wait_until_ready,
)

READY_TIMEOUT_S = 120.0


@dataclass
class RunningStack:
    """A tailcut stack started by ``tailcut_stack``: its URL, its Redis and every process id."""

    url: str
    redis_url: str
    pids: dict[str, int]  # "worker", "api", "redis"
    children: list[Child]
    ready_s: float

    def log_path(self, name: str) -> Path | None:
        return next((child.log_path for child in self.children if child.name == name), None)


# The benchmarks measure the pipeline in steady state: no cold-start ramp (``warmup.ramp``), and every
# request served by the engine (no answer cache: a repeated greedy prompt would not reach it), unless a
# benchmark's own ``env`` says otherwise.
STEADY_STATE = {"TAILCUT_WARMUP__STAGE1_S": "0", "TAILCUT_WARMUP__STAGE2_S": "0", "TAILCUT_CACHE_ENABLED": "false"}


@contextlib.contextmanager
def tailcut_stack(
    model_dir: Path,
    log_dir: Path,
    *,
    env: Mapping[str, str],
    worker_env: Mapping[str, str],
    api_env: Mapping[str, str] | None = None,
    log_tag: str = "",
    ready_timeout_s: float = READY_TIMEOUT_S,
    progress: Progress | None = None,
) -> Iterator[RunningStack]:
    """A private redis-server, one worker and the API (``env`` for both, ``worker_env`` / ``api_env`` for
    one); yields once ``/readyz`` says ready. Logs go to ``log_dir/worker.log`` and ``log_dir/api.log``
    (``worker-TAG.log`` with a ``log_tag``). Everything is stopped on exit, API first."""
    suffix = f"-{log_tag}" if log_tag else ""
    with private_redis() as redis:
        base = {**os.environ, **STEADY_STATE, **env, "TAILCUT_REDIS_URL": redis.url, "TAILCUT_MODEL": str(model_dir)}
        port = free_port()
        children: list[Child] = []
        try:
            started = time.monotonic()
            command = [sys.executable, "-m", "tailcut"]
            worker_log = log_dir / f"worker{suffix}.log"
            children.append(start_child("worker", [*command, "worker"], {**base, **worker_env}, log_path=worker_log))
            api_all = {**base, **(api_env or {}), "TAILCUT_PORT": str(port), "TAILCUT_HOST": "127.0.0.1"}
            children.append(start_child("api", [*command, "api"], api_all, log_path=log_dir / f"api{suffix}.log"))
            url = f"http://127.0.0.1:{port}"
            wait_until_ready(f"{url}/readyz", children, timeout_s=ready_timeout_s, what="tailcut", progress=progress)
            pids = {child.name: child.pid for child in children} | {"redis": redis.child.pid}
            yield RunningStack(url, redis.url, pids, children, time.monotonic() - started)
        finally:
            stop_children(children)


@contextlib.contextmanager
def log_folder(out: str | None, prefix: str) -> Iterator[Path]:
    """Where the child processes' logs go: ``OUT/logs``, else a temporary folder that is removed after a run
    that succeeded and kept after a failure (whose message points into it)."""
    if out:
        folder = Path(out) / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        yield folder
        return
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
