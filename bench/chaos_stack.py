"""The stack ``tailcut chaos`` runs against, and the faults it injects into it.

A private ``redis-server`` with AOF (``appendfsync always``) that can be SIGKILLed and restarted on the
same port and folder, the API, two or more workers (each with its own vLLM engine) and the batch-job
process, every one a child of the chaos run (``tailcut.processes``: they die with it).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.stack import STEADY_STATE
from tailcut.errors import ConfigError
from tailcut.processes import (
    Child,
    descendants,
    free_port,
    redis_answers,
    start_child,
    stop_child,
    stop_children,
    wait_until_ready,
)

READY_TIMEOUT_S = 300.0


@dataclass
class ChaosStack:
    model_dir: Path
    log_dir: Path
    num_workers: int
    env: Mapping[str, str]
    redis_port: int = field(default_factory=free_port)
    api_port: int = field(default_factory=free_port)
    redis: Child | None = None
    api: Child | None = None
    jobs: Child | None = None
    workers: dict[str, Child] = field(default_factory=dict)
    _redis_dir: Path | None = None
    _next_worker: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def _env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            **STEADY_STATE,
            **self.env,
            "TAILCUT_REDIS_URL": self.redis_url,
            "TAILCUT_MODEL": str(self.model_dir),
            **extra,
        }

    def start(self) -> float:
        """Start everything; seconds until ``/readyz`` said ready."""
        started = time.monotonic()
        self._redis_dir = Path(tempfile.mkdtemp(prefix="tailcut-chaos-redis-"))
        self.start_redis()
        for _ in range(self.num_workers):
            self.start_worker()
        command = [sys.executable, "-m", "tailcut"]
        self.jobs = start_child("jobs", [*command, "jobs"], self._env(), log_path=self.log_dir / "jobs.log")
        api_env = self._env(TAILCUT_PORT=str(self.api_port), TAILCUT_HOST="127.0.0.1")
        self.api = start_child("api", [*command, "api"], api_env, log_path=self.log_dir / "api.log")
        children = [child for child in (self.redis, self.jobs, self.api, *self.workers.values()) if child]
        wait_until_ready(f"{self.url}/readyz", children, timeout_s=READY_TIMEOUT_S, what="the chaos stack")
        self.wait_workers(self.num_workers)
        return time.monotonic() - started

    def wait_workers(self, count: int, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until ``count`` workers beat (a restarted one loads its engine for a while)."""
        import orjson

        from tailcut.processes import http_status

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status, body = http_status(f"{self.url}/readyz", timeout_s=1.0)
            if status == 200 and int(orjson.loads(body).get("workers", 0)) >= count:
                return
            time.sleep(0.5)
        raise ConfigError(f"fewer than {count} workers were serving after {timeout_s:.0f} s")

    def start_redis(self) -> None:
        assert self._redis_dir is not None
        binary = shutil.which("redis-server")
        if binary is None:
            raise ConfigError("redis-server is not installed: install Redis 7 (apt-get install redis-server)")
        argv = [
            binary,
            "--port", str(self.redis_port), "--bind", "127.0.0.1", "--dir", str(self._redis_dir),
            "--appendonly", "yes", "--appendfsync", "always", "--save", "",
            "--maxmemory-policy", "noeviction",
        ]  # fmt: skip
        self.redis = start_child("redis", argv, log_path=self.log_dir / "redis.log")
        deadline = time.monotonic() + 20
        while not redis_answers(self.redis_url):
            if self.redis.process.poll() is not None or time.monotonic() > deadline:
                raise ConfigError(f"redis-server did not start on port {self.redis_port}: {self.redis.failure()}")
            time.sleep(0.05)

    def restart_redis(self) -> float:
        """SIGKILL Redis and start it again on the same port and AOF folder; seconds it was away."""
        assert self.redis is not None
        started = time.monotonic()
        self.redis.process.kill()
        self.redis.process.wait(timeout=10)
        self.start_redis()
        return time.monotonic() - started

    def start_worker(self) -> str:
        name = f"worker-{self._next_worker}"
        self._next_worker += 1
        env = self._env(TAILCUT_WORKER_ID=f"chaos-{name}", TAILCUT_METRICS_PORT=str(free_port()))
        command = [sys.executable, "-m", "tailcut", "worker"]
        self.workers[name] = start_child(name, command, env, log_path=self.log_dir / f"{name}.log")
        return name

    def busiest_worker(self) -> str:
        """The worker holding the most requests right now (pending in its name), so that a fault
        there hits streams in flight."""
        import redis

        from queues.keys import WORKER_GROUP, Keys

        held = dict.fromkeys(self.workers, 0)
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
        try:
            for stream in Keys().intake_all():
                try:
                    summary: dict[str, Any] = client.xpending(stream, WORKER_GROUP)  # type: ignore[assignment]
                except redis.RedisError:
                    continue
                for consumer in summary.get("consumers") or []:
                    name = consumer["name"].decode().removeprefix("chaos-")
                    if name in held:
                        held[name] += int(consumer["pending"])
        finally:
            client.close()
        return max(sorted(held), key=held.__getitem__)

    def kill_worker(self, name: str) -> None:
        """SIGKILL the worker process alone, as a crash would (its engine dies with it)."""
        child = self.workers.pop(name)
        child.process.kill()
        child.process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while descendants(child.pid) and time.monotonic() < deadline:  # pragma: no cover - timing
            time.sleep(0.1)
        stop_child(child, timeout_s=1)  # sweeps its process group, whatever is left

    def stop_worker(self, name: str) -> float:
        """SIGTERM the worker and wait for it to drain and exit; seconds it took."""
        child = self.workers.pop(name)
        started = time.monotonic()
        stop_child(child, timeout_s=60)
        return time.monotonic() - started

    def engine_pid(self, name: str) -> int | None:
        """The EngineCore process of a worker."""
        cores = [pid for pid, row in descendants(self.workers[name].pid).items() if "EngineCore" in row[2]]
        return cores[0] if cores else None

    def pause_engine(self, name: str, seconds: float) -> bool:
        """SIGSTOP a worker's engine for ``seconds``, then SIGCONT (what makes heartbeats late)."""
        pid = self.engine_pid(name)
        if pid is None:
            return False
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        return True

    def stop(self) -> None:
        children = [child for child in (self.redis, *self.workers.values(), self.jobs, self.api) if child]
        stop_children(children, timeout_s=20)
        if self._redis_dir is not None:
            shutil.rmtree(self._redis_dir, ignore_errors=True)
