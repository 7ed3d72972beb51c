from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from tailcut.models import build_tiny

# Tests run the pipeline in steady state: workers open their whole capacity at once (the cold-start ramp,
# warmup.ramp, is off) and every request reaches a worker (the answer cache, api.answers, is off; tests
# that compare repeated greedy requests or count executions rely on it). Tests of either turn it on
# (tests/e2e/test_warmup.py, tests/e2e/test_answer_cache.py). Set before any settings are read;
# subprocesses inherit it.
os.environ.setdefault("TAILCUT_WARMUP__STAGE1_S", "0")
os.environ.setdefault("TAILCUT_WARMUP__STAGE2_S", "0")
os.environ.setdefault("TAILCUT_CACHE_ENABLED", "false")

REDIS_URL = os.environ.get("TAILCUT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
# Small KV cache for the shared test engine: 16 MiB holds 2,048 tokens of the tiny model (8 KiB each).
TEST_KV_CACHE_BYTES = 64 * 1024 * 1024
TEST_MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def redis_url() -> str:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        pytest.fail(f"tests need Redis at {REDIS_URL} (.ci/run starts one): {exc}")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
async def engine(tiny_model: Path) -> AsyncIterator[object]:
    """One real vLLM engine (CPU, tiny model) shared by every test of the session."""
    from workers.engines.vllm_engine import VllmEngine
    from workers.settings import EngineSettings

    started = VllmEngine.start(
        tiny_model,
        EngineSettings(kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, max_num_seqs=32),
        max_model_len=TEST_MAX_MODEL_LEN,
    )
    yield started
    await started.shutdown()


@pytest.fixture
async def prefixed_redis(redis_url: str) -> AsyncIterator[tuple[object, object]]:
    """A client of the test Redis and a key prefix of the test's own; its keys are deleted afterwards."""
    from queues.connection import connect
    from queues.keys import Keys
    from tests.stack import unique_prefix

    keys = Keys(unique_prefix())
    client = connect(redis_url, timeout_s=5.0)
    yield client, keys
    found = [key async for key in client.scan_iter(match=f"{keys.prefix}*")]
    if found:
        await client.delete(*found)
    await client.aclose()


@pytest.fixture
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# A test that comes within WATCHDOG_MARGIN_S of its timeout (pytest-timeout: 300 s, or its own
# ``timeout`` mark) prints every asyncio task's stack, then is cancelled, so a hang in CI says where it
# waits: the failure's traceback ends at the await that hung (pytest-timeout only shows the event loop's
# select()). TAILCUT_TEST_WATCHDOG_S sets the delay itself (to check the watchdog).
WATCHDOG_MARGIN_S = 15.0


def _watchdog_delay_s(request: pytest.FixtureRequest) -> float | None:
    if "TAILCUT_TEST_WATCHDOG_S" in os.environ:
        return float(os.environ["TAILCUT_TEST_WATCHDOG_S"])
    marker = request.node.get_closest_marker("timeout")
    if marker is not None and marker.args:
        timeout = float(marker.args[0])
    elif request.config.getoption("timeout", default=None) is not None:
        timeout = float(request.config.getoption("timeout"))
    else:
        timeout = float(request.config.getini("timeout") or 0)
    return timeout - WATCHDOG_MARGIN_S if timeout > 2 * WATCHDOG_MARGIN_S else None


@pytest.fixture(autouse=True)
async def asyncio_watchdog(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    import asyncio
    import sys

    delay_s = _watchdog_delay_s(request)
    if delay_s is None:
        yield
        return

    async def dump_after_delay() -> None:
        await asyncio.sleep(delay_s)
        print(f"\n--- asyncio tasks after {delay_s:.0f} s ---", file=sys.stderr)
        for task in asyncio.all_tasks():
            task.print_stack(limit=8, file=sys.stderr)
        for task in asyncio.all_tasks():
            if getattr(task.get_coro(), "__qualname__", "").split(".")[-1] == request.node.originalname:
                task.cancel(f"still running after {delay_s:.0f} s: cancelled by tests/conftest.py's watchdog")

    watchdog = asyncio.create_task(dump_after_delay())
    yield
    watchdog.cancel()
