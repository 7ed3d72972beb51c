"""`tailcut up` as a user runs it: a child process tree that serves, then stops cleanly on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from tailcut.up import private_redis

pytestmark = pytest.mark.engine


def test_private_redis_starts_answers_and_stops() -> None:
    with private_redis() as url:
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        client.close()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()


def test_tailcut_up_serves_a_stream_and_stops_on_ctrl_c(tiny_model: Path, free_port: int, redis_url: str) -> None:
    env = {
        **os.environ,
        "TAILCUT_KEY_PREFIX": f"up{free_port}:",
        "TAILCUT_ENGINE__KV_CACHE_MEMORY_BYTES": str(64 << 20),
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tailcut",
            "up",
            "--model",
            str(tiny_model),
            "--port",
            str(free_port),
            "--redis-url",
            redis_url,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{free_port}"
    printed: list[str] = []
    assert process.stdout is not None
    reader = threading.Thread(target=lambda: printed.extend(process.stdout or []), daemon=True)
    reader.start()
    try:
        # Ready when `tailcut up` itself says so (it polls /readyz), not merely when /readyz answers:
        # a Ctrl-C before that would stop it mid-start.
        deadline = time.monotonic() + 240
        while not any("tailcut is up" in line for line in printed):
            assert process.poll() is None, "".join(printed)
            assert time.monotonic() < deadline, "tailcut up was not ready in time"
            time.sleep(0.2)
        assert httpx.get(f"{base}/readyz", timeout=5).status_code == 200
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
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=90)
        reader.join(timeout=10)
        process.stdout.close()
    output = "".join(printed)
    assert process.returncode == 0, output
    assert "tailcut is up" in output and "curl -N" in output
