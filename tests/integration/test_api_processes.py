"""Several API processes on one port (``tailcut api --processes 2``): one pooled /metrics, a wiped metrics
folder at start, a dead process replaced, a stop that reaches every process, and no process left behind
by a SIGKILL."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tailcut.processes import start_child
from tests.procs import descendants, processes
from tests.stack import unique_prefix

REQUESTS = 8


def admitted(text: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tailcut_requests_admitted_total"
    )


def wait_healthy(base: str, child: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert child.poll() is None, log.read_text()
        try:
            if httpx.get(f"{base}/status/data", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def test_two_api_processes_share_one_port_and_pool_their_metrics(
    tiny_model: Path, free_port: int, redis_url: str, tmp_path: Path
) -> None:
    folder = tmp_path / "metrics"
    folder.mkdir()
    (folder / "counter_999999.db").write_bytes(b"left by an earlier run")
    prefix = unique_prefix()
    env = {
        **os.environ,
        "TAILCUT_REDIS_URL": redis_url,
        "TAILCUT_KEY_PREFIX": prefix,
        "TAILCUT_METRICS_DIR": str(folder),
        "TAILCUT_SHUTDOWN_GRACE_S": "1",
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    argv = [sys.executable, "-m", "tailcut", "api", "--processes", "2", "--model", str(tiny_model)]
    log = tmp_path / "api.log"
    api = start_child("api", [*argv, "--port", str(free_port)], env, log_path=log)
    base = f"http://127.0.0.1:{free_port}"
    try:
        wait_healthy(base, api.process, log)
        assert not (folder / "counter_999999.db").exists()
        # Both processes answer on the port, each with its own reply channel.
        seen: set[str] = set()
        for _ in range(60):
            with httpx.Client(base_url=base, timeout=5) as client:  # a new connection each time
                seen.add(client.get("/status/data").json()["api_id"])
            if len(seen) == 2:
                break
        assert len(seen) == 2, seen
        # No worker runs: each request is admitted, waits, and is cancelled when its client leaves.
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}
        for _ in range(REQUESTS):
            with httpx.Client(base_url=base, timeout=0.3) as client:
                try:
                    client.post("/v1/completions", json=body)
                except httpx.TimeoutException:
                    pass
        pids = {path.stem.rsplit("_", 1)[1] for path in folder.glob("counter_*.db")}
        assert len(pids) == 2, sorted(path.name for path in folder.iterdir())
        # Whichever process answers the scrape counts the requests of both.
        for _ in range(10):
            with httpx.Client(base_url=base, timeout=5) as client:
                assert admitted(client.get("/metrics").text) == REQUESTS
        # A process that dies is replaced; the pooled counts survive it (its files stay).
        children = [pid for pid, row in descendants(api.pid).items() if row[0] == api.pid and "spawn_main" in row[2]]
        assert len(children) == 2, descendants(api.pid)
        os.kill(children[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            now = [pid for pid, row in descendants(api.pid).items() if row[0] == api.pid and "spawn_main" in row[2]]
            if len(now) == 2 and children[0] not in now:
                break
            assert time.monotonic() < deadline, f"no replacement for {children[0]}: {now}"
            time.sleep(0.2)
        while log.read_text().count("api_started") < 3:  # the replacement serves
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert "api_process_died" in log.read_text()
        with httpx.Client(base_url=base, timeout=5) as client:
            assert admitted(client.get("/metrics").text) == REQUESTS
        tree = descendants(api.pid)
        assert len(tree) >= 2, tree
    finally:
        api.process.send_signal(signal.SIGTERM)
        code = api.process.wait(timeout=30)
    assert code == 0, log.read_text()
    deadline = time.monotonic() + 5  # multiprocessing's resource tracker ends just after its parent
    while (left := [pid for pid in tree if pid in processes()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"API processes still running after the supervisor stopped: {left}"
    text = log.read_text()
    assert text.count("api_stopped") == 2, text  # the survivor and the replacement


def test_a_sigkilled_supervisor_takes_its_api_processes_with_it(
    tiny_model: Path, free_port: int, redis_url: str, tmp_path: Path
) -> None:
    env = {**os.environ, "TAILCUT_REDIS_URL": redis_url, "TAILCUT_KEY_PREFIX": unique_prefix()}
    env["TAILCUT_METRICS_DIR"] = str(tmp_path / "metrics")
    argv = [sys.executable, "-m", "tailcut", "api", "--processes", "2", "--model", str(tiny_model)]
    log = tmp_path / "api.log"
    api = start_child("api", [*argv, "--port", str(free_port)], env, log_path=log)
    wait_healthy(f"http://127.0.0.1:{free_port}", api.process, log)
    tree = descendants(api.pid)
    api.process.kill()
    api.process.wait(timeout=10)
    deadline = time.monotonic() + 10
    while (left := [pid for pid in tree if pid in processes()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after kill -9 of the supervisor: {left}"


def test_an_idle_client_connection_stays_open_for_the_keep_alive_time(
    tiny_model: Path, free_port: int, redis_url: str, tmp_path: Path
) -> None:
    """``TAILCUT_KEEP_ALIVE_S`` reaches the server of ``tailcut api``: an idle connection is still open
    well into it (so a client whose own idle limit is shorter never sends on a connection the server is
    closing: at uvicorn's default 5 s, which is also httpx's, such requests failed with resets) and is
    closed after it."""
    env = {**os.environ, "TAILCUT_REDIS_URL": redis_url, "TAILCUT_KEY_PREFIX": unique_prefix()}
    env["TAILCUT_METRICS_DIR"] = str(tmp_path / "metrics")
    env["TAILCUT_KEEP_ALIVE_S"] = "7"  # uvicorn's own default is 5 s
    argv = [sys.executable, "-m", "tailcut", "api", "--model", str(tiny_model), "--port", str(free_port)]
    log = tmp_path / "api.log"
    api = start_child("api", argv, env, log_path=log)
    try:
        wait_healthy(f"http://127.0.0.1:{free_port}", api.process, log)
        client = http.client.HTTPConnection("127.0.0.1", free_port, timeout=10)
        client.request("GET", "/healthz")
        response = client.getresponse()
        response.read()  # the whole body: one recv may return the headers alone
        assert response.status == 200, "no answer to the first request"
        assert client.sock is not None, "the client closed a keep-alive connection"
        with client.sock as connection:
            answered = time.monotonic()
            time.sleep(5.5)  # past uvicorn's default, within ours: the connection is still open
            connection.setblocking(False)
            try:
                data = connection.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                data = None
            assert data is None, f"the server closed an idle connection after {time.monotonic() - answered:.1f} s"
            connection.settimeout(10)
            assert connection.recv(1) == b"", "the server kept an idle connection past TAILCUT_KEEP_ALIVE_S"
            closed_after_s = time.monotonic() - answered
        assert 6.5 < closed_after_s < 10, closed_after_s
    finally:
        api.process.send_signal(signal.SIGTERM)
        api.process.wait(timeout=30)
