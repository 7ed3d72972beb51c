"""The OpenAPI document says what the server does: schemathesis (every check, bounded examples) against
the whole stack — API, Redis, a worker on the null engine — with API keys off and on, finds nothing.
The one rule the document cannot state (prompt + max_tokens within the context) is the hooks module's."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.stack import tailcut_stack
from queues.apikeys import KeyStore
from queues.connection import connect
from queues.keys import Keys

pytestmark = pytest.mark.timeout(900)
# Bounded for the suite's time: the examples, fuzzing and stateful phases, a few cases per operation
# (the coverage phase and larger runs: `schemathesis run` by hand, figures in BENCHMARKS.md).
MAX_EXAMPLES = "10"
SECRET = "fuzzing-secret"


async def create_key(redis_url: str) -> str:
    redis = connect(redis_url, timeout_s=5)
    try:
        key, _ = await KeyStore(redis, Keys(), SECRET).create("fuzz", admin=True)
        return key
    finally:
        await redis.aclose()


def fuzz(model_dir: Path, log_dir: Path, *, auth: bool) -> subprocess.CompletedProcess[str]:
    env = {"TAILCUT_ENGINE__KIND": "null", "TAILCUT_ENGINE__NULL_STEP_MS": "1", "TAILCUT_MAX_MODEL_LEN": "2048"}
    if auth:
        env |= {"TAILCUT_AUTH_REQUIRED": "true", "TAILCUT_AUTH_SECRET": SECRET}
    with tailcut_stack(model_dir, log_dir, env=env, worker_env={}, log_tag="auth" if auth else "open") as stack:
        headers = ["-H", f"Authorization: Bearer {asyncio.run(create_key(stack.redis_url))}"] if auth else []
        command = [
            sys.executable, "-m", "schemathesis.cli", "run", f"{stack.url}/openapi.json",
            "--checks", "all", "--exclude-checks", "positive_data_acceptance",
            "--phases", "examples,fuzzing,stateful",
            "--max-examples", MAX_EXAMPLES, "--seed", "7", "--request-timeout", "10", "--output-sanitize", "false",
            *headers,
        ]  # fmt: skip
        hooks = {"SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks", "PYTHONPATH": str(Path(__file__).parents[2])}
        return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **hooks}, timeout=600)


@pytest.mark.parametrize("auth", [False, True], ids=["keys-off", "keys-on"])
async def test_schemathesis_finds_no_failure(tiny_model: Path, tmp_path: Path, auth: bool) -> None:
    done = await asyncio.to_thread(fuzz, tiny_model, tmp_path, auth=auth)
    summary = done.stdout[-8000:]
    assert done.returncode == 0, summary + done.stderr[-2000:]
    assert "generated" in summary and "21 selected" in done.stdout, summary  # it ran, on every operation
