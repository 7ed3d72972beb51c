"""`tailcut up` as a user runs it: a child process tree that serves, stops cleanly on Ctrl-C, reads its
settings from the environment, and dies with it when it is killed with SIGKILL (workers, vLLM's engine
process, the API, the jobs process and a private redis-server alike)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tailcut.processes import private_redis
from tests.procs import descendants, processes

pytestmark = pytest.mark.engine

READY_TIMEOUT_S = 240
GONE_WITHIN_S = 10


def test_private_redis_starts_answers_and_stops() -> None:
    with private_redis() as server:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        client.close()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url, socket_connect_timeout=0.5).ping()


def survivors(tree: dict[int, tuple[int, int, str]], groups: set[int]) -> list[str]:
    """Processes of ``tree`` still alive, or any process still in one of ``groups``."""
    table = processes()
    return [f"{pid} {row[2]}" for pid, row in table.items() if pid in tree or row[1] in groups]


def kill_and_expect_all_gone(process: subprocess.Popen[str], tree: dict[int, tuple[int, int, str]], what: str) -> None:
    """``kill -9`` of ``process``: within ``GONE_WITHIN_S`` every process of ``tree``, and every process in
    their process groups, must be gone. Whatever is left is killed, so a failure leaves nothing running."""
    groups = {row[1] for row in tree.values()} - {os.getpgrp()}
    process.kill()
    process.wait(timeout=10)
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := survivors(tree, groups)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    assert not left, f"still running {GONE_WITHIN_S} s after kill -9 of {what}: {left}"


@contextlib.contextmanager
def printed_lines(process: subprocess.Popen[str]) -> Iterator[list[str]]:
    """What ``process`` prints (stdout and stderr), collected as it comes."""
    printed: list[str] = []
    assert process.stdout is not None
    reader = threading.Thread(target=lambda: printed.extend(process.stdout or []), daemon=True)
    reader.start()
    try:
        yield printed
    finally:
        reader.join(timeout=10)
        process.stdout.close()


def wait_until_up(process: subprocess.Popen[str], printed: list[str]) -> None:
    """Ready when `tailcut up` itself says so (it polls /readyz), not merely when /readyz answers: a
    Ctrl-C before that would stop it mid-start."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not any("tailcut is up" in line for line in printed):
        assert process.poll() is None, "".join(printed)
        assert time.monotonic() < deadline, "tailcut up was not ready in time"
        time.sleep(0.2)


def stream_a_reply(base: str) -> None:
    body = {
        "model": "tiny",
        "stream": True,
        "max_tokens": 6,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) >= 3


def test_tailcut_up_serves_a_stream_and_stops_on_ctrl_c(tiny_model: Path, free_port: int, redis_url: str) -> None:
    env = {
        **os.environ,
        "TAILCUT_KEY_PREFIX": f"up{free_port}:",
        "TAILCUT_ENGINE__KV_CACHE_MEMORY_BYTES": str(64 << 20),
    }
    command = [sys.executable, "-m", "tailcut", "up", "--model", str(tiny_model), "--port", str(free_port)]
    command += ["--redis-url", redis_url]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{free_port}"
    with printed_lines(process) as printed:
        try:
            wait_until_up(process, printed)
            assert httpx.get(f"{base}/readyz", timeout=5).status_code == 200
            stream_a_reply(base)
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=90)
    output = "".join(printed)
    assert process.returncode == 0, output
    assert "tailcut is up" in output and "curl -N" in output


def test_tailcut_up_reads_the_environment_and_its_children_die_with_it(
    tiny_model: Path, free_port: int, redis_url: str
) -> None:
    """No flag: TAILCUT_PORT, TAILCUT_MODEL and TAILCUT_REDIS_URL decide. Then `kill -9` of `tailcut up`:
    within 10 s no worker, vLLM engine process, jobs process or API is left."""
    env = {
        **os.environ,
        "TAILCUT_PORT": str(free_port),
        "TAILCUT_MODEL": str(tiny_model),
        "TAILCUT_REDIS_URL": redis_url,
        "TAILCUT_KEY_PREFIX": f"up{free_port}:",
        "TAILCUT_ENGINE__KV_CACHE_MEMORY_BYTES": str(64 << 20),
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the worker's own default decides
    command = [sys.executable, "-m", "tailcut", "up"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with printed_lines(process) as printed:
        try:
            wait_until_up(process, printed)
            base = f"http://127.0.0.1:{free_port}"
            words = " ".join("".join(printed).split())  # the console wraps long lines
            assert f"tailcut is up at {base}" in words and f"Redis {redis_url}" in words, "".join(printed)
            stream_a_reply(base)
            tree = descendants(process.pid)
            commands = [row[2] for row in tree.values()]
            for name in ("tailcut worker", "tailcut jobs", "tailcut api"):
                assert any(name in line for line in commands), commands
            # The worker's vLLM engine core is a grandchild: PDEATHSIG of the worker alone misses it.
            worker = next(pid for pid, row in tree.items() if "tailcut worker" in row[2])
            assert any(row[0] == worker for row in tree.values()), f"no engine process under the worker: {commands}"
            # On CPU the model runs in the engine core (README): no model process of its own under it.
            core = next(pid for pid, row in tree.items() if row[0] == worker and "EngineCore" in row[2])
            assert not any(row[0] == core for row in tree.values()), f"a process under the engine core: {commands}"
            kill_and_expect_all_gone(process, tree, "tailcut up")
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)


OWNER = """
import sys, time
from tailcut.processes import private_redis, start_child
with private_redis() as server:
    child = start_child("forker", [sys.executable, "-c", "import os, time; os.fork(); time.sleep(600)"])
    print(server.url, flush=True)
    time.sleep(600)
"""


def test_a_private_redis_server_and_grandchildren_die_with_their_parent() -> None:
    """What `tailcut up` and the benchmarks start with ``tailcut.processes``: a private redis-server, and a
    child whose own child PDEATHSIG does not cover, are gone soon after their parent is killed with SIGKILL."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        url = owner.stdout.readline().strip()
        assert redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        deadline = time.monotonic() + 10
        while len(tree := descendants(owner.pid)) < 4 and time.monotonic() < deadline:  # + the watchdog
            time.sleep(0.1)
        commands = [row[2] for row in tree.values()]
        assert any("redis-server" in line for line in commands) and sum("os.fork()" in c for c in commands) == 2
        kill_and_expect_all_gone(owner, tree, "their parent")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
