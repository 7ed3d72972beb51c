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


# A test still running this long prints every asyncio task's stack, so a hang in CI says where it
# waits (pytest-timeout only shows the event loop's select()). Below the per-test timeout of 300 s.
WATCHDOG_S = 240


@pytest.fixture(autouse=True)
async def asyncio_watchdog() -> AsyncIterator[None]:
    import asyncio
    import sys

    async def dump_after_delay() -> None:
        await asyncio.sleep(WATCHDOG_S)
        print(f"\n--- asyncio tasks after {WATCHDOG_S} s ---", file=sys.stderr)
        for task in asyncio.all_tasks():
            task.print_stack(limit=8, file=sys.stderr)

    watchdog = asyncio.create_task(dump_after_delay())
    yield
    watchdog.cancel()
