"""``tailcut up``: the whole stack on one machine, for trying tailcut out.

Starts a private ``redis-server`` (temporary folder, free port) unless ``--redis-url`` is given or a
Redis answers on the default address, then the worker(s), one batch-job process (``tailcut jobs``) and
the API as child processes; waits until ``/readyz`` says ready, prints the URL and a curl to paste,
and on Ctrl-C stops everything in reverse order.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from rich.console import Console

from tailcut.errors import ConfigError
from tailcut.models import resolve_model, served_name
from tailcut.settings import CommonSettings

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 40.0

console = Console(stderr=True, highlight=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A throwaway ``redis-server`` on a free port; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError(
            "no Redis answers on 127.0.0.1:6379 and redis-server is not installed: install Redis 7 "
            "(apt-get install redis-server) or pass --redis-url"
        )
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tailcut-redis-") as folder:
        process = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                folder,
                "--maxmemory-policy",
                "noeviction",
            ],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        url = f"redis://127.0.0.1:{port}/0"
        try:
            deadline = time.monotonic() + 10
            while not redis_answers(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise ConfigError(f"redis-server did not start on port {port}")
                time.sleep(0.1)
            yield url
        finally:
            stop_process(process, "redis")


def stop_process(process: subprocess.Popen[bytes], name: str) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        console.log(f"{name} did not stop in {STOP_TIMEOUT_S:.0f} s; killing it")
        process.kill()
        process.wait()


def wait_ready(url: str, children: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with console.status("starting: loading the model into the worker(s)") as status:
        while time.monotonic() < deadline:
            for name, child in children:
                if child.poll() is not None:
                    raise ConfigError(f"{name} exited with status {child.returncode} during start; see its log above")
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=1) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                status.update(f"starting: {exc.read().decode(errors='replace')[:120]}")
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
    raise ConfigError(f"the stack was not ready after {READY_TIMEOUT_S:.0f} s")


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM both raise ``KeyboardInterrupt``, so a command that started processes stops
    them on its way out instead of leaving them running. SIGINT may arrive ignored when the command
    was started in the background, so its handler is installed explicitly."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def up(*, model: str, port: int, redis_url: str | None, num_workers: int) -> int:
    interrupt_on_signals()  # the stack stops in order
    settings = CommonSettings(model=model)
    with console.status("preparing the model"):
        model_dir = resolve_model(settings.model, settings.cache_dir, progress=console.log)
    name = served_name(model_dir, settings.served_model_name)
    with contextlib.ExitStack() as stack:
        if redis_url is None:
            if redis_answers(DEFAULT_REDIS_URL):
                redis_url = DEFAULT_REDIS_URL
            else:
                redis_url = stack.enter_context(private_redis())
                console.log(f"started a private redis-server at {redis_url}")
        env = {**os.environ, "TAILCUT_REDIS_URL": redis_url, "TAILCUT_MODEL": str(model_dir)}
        children: list[tuple[str, subprocess.Popen[bytes]]] = []
        try:
            for index in range(num_workers):
                children.append(
                    (
                        f"worker {index + 1}",
                        subprocess.Popen([sys.executable, "-m", "tailcut", "worker"], env=env, start_new_session=True),
                    )
                )
            children.append(
                ("jobs", subprocess.Popen([sys.executable, "-m", "tailcut", "jobs"], env=env, start_new_session=True))
            )
            api_env = {**env, "TAILCUT_PORT": str(port), "TAILCUT_HOST": "127.0.0.1"}
            children.append(
                ("api", subprocess.Popen([sys.executable, "-m", "tailcut", "api"], env=api_env, start_new_session=True))
            )
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, children)
            console.print(f"\n[bold green]tailcut is up[/] at {url} — model {name}, Redis {redis_url}\n")
            console.print(
                f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
                f'-d \'{{"model": "{name}", "stream": true, "messages": '
                '[{"role": "user", "content": "What is the capital of France?"}]}\'\n',
                soft_wrap=True,
            )
            console.print(f"Batch log analysis: tailcut jobs submit FILE --url {url}\n")
            console.print("Ctrl-C stops everything.")
            while all(child.poll() is None for _name, child in children):
                time.sleep(0.5)
            for child_name, child in children:
                if child.returncode is not None:
                    console.log(f"{child_name} exited with status {child.returncode}; stopping")
            return 1
        except KeyboardInterrupt:
            console.print("\nstopping")
            return 0
        finally:
            # Reverse order: the API stops taking requests first, then the jobs process cancels its
            # requests and hands its jobs back to the queue, then the workers drain.
            for child_name, child in reversed(children):
                stop_process(child, child_name)
