"""Child processes, started and stopped one way by ``tailcut up``, the benchmarks and the tests.

Every child started here:

- leads its own session and process group, so a terminal's Ctrl-C reaches only the parent (which stops
  its children in order), and so a child's helpers are stopped with it: a vLLM worker's engine-core
  process, and that one's own worker process, are in the worker's group;
- dies with its parent, even when the parent is killed with SIGKILL. Two mechanisms, because one is
  not enough. ``PR_SET_PDEATHSIG`` = SIGKILL (Linux) kills the child itself; it is set only for a child
  started from the main thread, because the kernel fires it when the parent *thread* that started the
  child ends. It does not reach grandchildren (it is cleared on fork), and vLLM's engine core, forked
  by the worker, never notices that the worker is gone. So the first child a process starts also
  starts that process's **watchdog**: a small process of its own that the parent tells, over a pipe,
  which process groups it started; when the pipe closes (the parent ended, however it ended) or the
  watchdog finds itself reparented, it kills every group still registered with SIGKILL, and exits.
  A child stopped in order is taken off the watchdog's list first.

Nothing here imports the rest of tailcut (api, admission, queues, workers, jobs, bench): it sits in the
shared kernel, below everything that starts processes.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tailcut.errors import ConfigError, FatalError

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_TIMEOUT_S = 20.0
WATCH_POLL_S = 0.5  # how often the watchdog checks that its parent is still the one that started it
LOG_TAIL_LINES = 30
ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception): ")

Progress = Callable[[str], None]


# --- small probes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_status(url: str, *, timeout_s: float = 2.0) -> tuple[int | None, str]:
    """The status and body of a GET, or (None, "") when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None, ""


def redis_answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM both raise ``KeyboardInterrupt``, so a command that started processes stops
    them on its way out instead of leaving them running. SIGINT may arrive ignored when the command
    was started in the background, so its handler is installed explicitly."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


# --- dying with the parent ------------------------------------------------------------------------


class _Watchdog:
    """This process's watchdog (see the module's docstring): one per process, started with its first child."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._groups: set[int] = set()  # what the watchdog must kill if this process dies now

    def guard(self, pgid: int) -> None:
        with self._lock:
            self._groups.add(pgid)
            self._send(f"+{pgid}\n")

    def release(self, pgid: int) -> None:
        with self._lock:
            self._groups.discard(pgid)
            self._send(f"-{pgid}\n")

    def _send(self, line: str) -> None:
        """Tell the watchdog ``line``; one that is not running (yet, or any more) is started and told every
        group still guarded."""
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-c", "from tailcut.processes import watch; watch()", str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C for the parent's group does not reach it
            )
            line = "".join(f"+{pgid}\n" for pgid in self._groups)
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(line.encode())
            self._process.stdin.flush()
        except BrokenPipeError:  # it died: the next line starts another
            self._process = None

    def forget_after_fork(self) -> None:
        """In a forked child (``multiprocessing``, vLLM's engine core): the copy of the pipe must not keep
        the parent's watchdog waiting after the parent died. The descriptor is pointed at /dev/null rather
        than closed, so the inherited file object can still be closed or flushed harmlessly."""
        process, self._process, self._lock, self._groups = self._process, None, threading.Lock(), set()
        if process is not None and process.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, process.stdin.fileno())
                os.close(null)


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.forget_after_fork)


def watch() -> None:
    """The watchdog's main (``sys.argv[1]``: the parent's pid): reads ``+PGID`` / ``-PGID`` lines from stdin;
    when stdin ends or the parent is gone, kills every process group still listed with SIGKILL."""
    parent = int(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    groups: set[int] = set()
    pending = b""
    stdin = sys.stdin.fileno()
    orphaned = False
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05 if orphaned else WATCH_POLL_S)
        if not readable:
            if orphaned:  # a copy of the pipe is still open somewhere, but what was written has been read
                break
            orphaned = os.getppid() != parent
            continue
        data = os.read(stdin, 4096)
        if not data:
            break
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                (groups.add if line.startswith(b"+") else groups.discard)(int(line[1:]))
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def die_with_parent(parent_pid: int) -> bool:
    """Make the calling process get SIGKILL when the thread that started it exits (``PR_SET_PDEATHSIG``);
    if ``parent_pid`` is already gone, die now. False where it cannot (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was set
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def exit_without_a_last_collection() -> None:
    """At exit, skip the interpreter's last cyclic garbage collection: in a process that loaded torch and
    vLLM it walks millions of objects, 3–4 s of a slow core, for memory the system takes back with the
    process anyway. It made every worker's stop that much longer, and vLLM's CPU model worker outlast
    the 5 s its engine core waits, which then ended in a SIGKILL. Destructors outside reference cycles
    still run and ``logging`` still flushes its handlers (its own exit hook, registered earlier, runs
    after this one)."""
    import atexit
    import gc

    atexit.register(gc.freeze)


def _death_signal_setter() -> Callable[[], None] | None:
    """A ``preexec_fn`` that sets ``PR_SET_PDEATHSIG`` = SIGKILL in the child, or None where it cannot
    (not Linux, no libc, not the main thread: see the module's docstring)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_death_signal() -> None:  # runs in the child between fork and exec
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the signal was set
            os.kill(os.getpid(), signal.SIGKILL)

    return set_death_signal


# --- one child ------------------------------------------------------------------------------------


@dataclass
class Child:
    """A child process leading its own process group; its output in ``log_path`` (None: the parent's)."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def log_errors(self, limit: int = 5) -> list[str]:
        """The first distinct exception lines of the log (``XError: message``): the root cause of a failed
        start is usually far above the tail of a long traceback."""
        try:
            text = self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return []
        found: dict[str, None] = {}
        for line in text.splitlines():
            match = ERROR_LINE.search(line)
            if match and "WARNING" not in line:
                found.setdefault(line[match.start() :].strip(), None)
        return list(found)[:limit]

    def failure(self) -> str:
        """What to show when the child died: its errors, then the tail of its log."""
        if self.log_path is None:
            return "see its output above"
        errors = "".join(f"\n  {line}" for line in self.log_errors())
        found = f"errors in its log:{errors}\n" if errors else ""
        return f"{found}last lines of {self.log_path}:\n{self.log_tail()}"


def start_child(
    name: str,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    log_path: Path | None = None,
    stdout: int | IO[bytes] | None = None,
) -> Child:
    """Start ``argv`` as a child that dies with this process (see the module's docstring). Its output goes
    to ``log_path`` (truncated), else to ``stdout`` (None: this process's own); stdin is /dev/null."""
    death_signal = _death_signal_setter()
    with contextlib.ExitStack() as files:
        if log_path is not None:
            stdout = files.enter_context(log_path.open("wb"))
        process = subprocess.Popen(
            list(argv),
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT if log_path is not None else None,
            start_new_session=True,
            preexec_fn=death_signal,  # only from the main thread: see _death_signal_setter
        )
    _WATCHDOG.guard(process.pid)
    return Child(name, process, log_path)


def stop_child(child: Child, *, timeout_s: float = STOP_TIMEOUT_S, progress: Progress | None = None) -> None:
    """SIGTERM the child (it stops its own helpers, such as vLLM's engine process), wait up to ``timeout_s``,
    then SIGKILL whatever is left of its process group."""
    process = child.process
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            if progress is not None:
                progress(f"{child.name} did not stop in {timeout_s:.0f} s; killing it")
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # the group outlives its leader: sweep the helpers too
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)
    _WATCHDOG.release(process.pid)


def stop_children(
    children: Sequence[Child], *, timeout_s: float = STOP_TIMEOUT_S, progress: Progress | None = None
) -> None:
    """Stop ``children`` last started first."""
    for child in reversed(children):
        stop_child(child, timeout_s=timeout_s, progress=progress)


def stop_together(
    children: Sequence[Child], *, timeout_s: float = STOP_TIMEOUT_S, progress: Progress | None = None
) -> None:
    """SIGTERM all of ``children`` at once and give them ``timeout_s`` together (workers that drain in
    parallel), then stop each as ``stop_child`` does."""
    for child in children:
        if child.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        stop_child(child, timeout_s=max(0.0, deadline - time.monotonic()), progress=progress)


def wait_until_ready(
    url: str,
    children: Sequence[Child],
    *,
    timeout_s: float,
    what: str,
    progress: Progress | None = None,
    on_answer: Callable[[int, str], None] | None = None,
    poll_s: float = 0.25,
) -> float:
    """Poll ``url`` until it answers 200; seconds waited. A child that exits, or the time limit, raises
    ``FatalError`` with what the children's logs say. ``on_answer`` sees every other answer (status,
    body); ``progress`` gets a line every 10 s."""
    started = time.monotonic()
    next_note = started + 10
    while True:
        for child in children:
            if child.process.poll() is not None:
                raise FatalError(
                    f"{child.name} exited with status {child.process.returncode} while starting {what}; "
                    + child.failure()
                )
        status, body = http_status(url, timeout_s=1.0)
        if status == 200:
            return time.monotonic() - started
        if status is not None and on_answer is not None:
            on_answer(status, body)
        now = time.monotonic()
        if now - started > timeout_s:
            tails = "\n".join(f"--- {child.name}: {child.failure()}" for child in children)
            raise FatalError(f"{what} was not ready after {timeout_s:.0f} s ({url}):\n{tails}")
        if progress is not None and now >= next_note:
            progress(f"still starting {what}: {now - started:.0f} s")
            next_note = now + 10
        time.sleep(poll_s)


def wait_for_port(port: int, child: Child, *, timeout_s: float = 20.0) -> None:
    """Wait until something listens on ``port`` of the loopback (``child`` must not exit meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.process.poll() is not None:
            raise FatalError(f"{child.name} exited with status {child.process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise FatalError(f"{child.name} did not listen on port {port} in {timeout_s:.0f} s")


# --- the process table -----------------------------------------------------------------------------


def process_table() -> dict[int, tuple[int, int, str]]:
    """Every live process (Linux /proc): pid → (parent pid, process group, command line); zombies left out."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
            if fields[0] != "Z":
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found[int(entry.name)] = (int(fields[1]), int(fields[2]), command.strip())
    return found


def descendants(pid: int) -> dict[int, tuple[int, int, str]]:
    """The live processes below ``pid``: its children, theirs, and so on."""
    table = process_table()
    below: dict[int, tuple[int, int, str]] = {}
    parents = {pid}
    while parents:
        children = {child: row for child, row in table.items() if row[0] in parents and child not in below}
        below |= children
        parents = set(children)
    return below


# --- a private redis-server -----------------------------------------------------------------------


@dataclass
class RedisServer:
    """A ``redis-server`` started by ``private_redis``."""

    url: str
    child: Child

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.child.process

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


@contextlib.contextmanager
def private_redis(port: int | None = None, *extra: str) -> Iterator[RedisServer]:
    """A throwaway ``redis-server`` (no persistence, ``noeviction`` unless ``extra`` sets a policy) on
    ``port`` or a free one, in a temporary folder; stopped on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError(
            "no Redis answers on 127.0.0.1:6379 and redis-server is not installed: install Redis 7 "
            "(apt-get install redis-server) or pass --redis-url"
        )
    port = free_port() if port is None else port
    policy = [] if "--maxmemory-policy" in extra else ["--maxmemory-policy", "noeviction"]
    with tempfile.TemporaryDirectory(prefix="tailcut-redis-") as folder:
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        child = start_child("redis", [*argv, "--dir", folder, *policy, *extra], stdout=subprocess.DEVNULL)
        server = RedisServer(f"redis://127.0.0.1:{port}/0", child)
        try:
            deadline = time.monotonic() + 10
            while not redis_answers(server.url):
                if child.process.poll() is not None or time.monotonic() > deadline:
                    raise ConfigError(f"redis-server did not start on port {port}")
                time.sleep(0.05)
            yield server
        finally:
            stop_child(child, timeout_s=10)
