"""TTFT of sequential streamed chat requests with a short text message (about 110 characters), through
a private stack with the null engine (``bench.stack``, as ``tailcut bench overhead`` starts it); the
first 50 requests are left out. An A/B of two trees, run alternately from each tree's root:

    cd TREE && PYTHONPATH=$PWD /work/main/.venv/bin/python \\
        docs/benchmarks/overhead-issue13/text-prompt-ab/ttft_chat.py 600

(the benchmark's own clients send token ids, which are not tokenized; this one sends text).
"""

import asyncio
import json
import pathlib
import re
import statistics
import sys
import tempfile
import time

from bench.stack import tailcut_stack
from tailcut.models import served_name

MODEL_DIR = pathlib.Path.home() / ".cache/tailcut/models/tiny"
WORKER_ENV = {
    "TAILCUT_ENGINE__KIND": "null",
    "TAILCUT_ENGINE__MAX_NUM_SEQS": "8",
    "TAILCUT_MAX_RUNNING": "8",
    "TAILCUT_ENGINE__NULL_STEP_MS": "0",
    "TAILCUT_SCHEDULER__POLICY": "tailcut",
}
TEXT = "Explain the difference between TCP and UDP in two sentences, with an example of each protocol in use."
SKIPPED = 50


async def measure(url: str, count: int) -> list[float]:
    host, port = url.removeprefix("http://").split(":")
    model = served_name(MODEL_DIR, None)
    reader, writer = await asyncio.open_connection(host, int(port))
    ttfts = []
    for index in range(count):
        body = json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": f"{index} {TEXT}"}],
                "max_completion_tokens": 16,
                "stream": True,
            }
        ).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sent = time.perf_counter()
        writer.write(head.encode() + body)
        first, received = 0.0, b""
        while not received.endswith(b"0\r\n\r\n"):
            received += await reader.read(65536)
            if not first and re.search(rb'"content":"[^"]', received):
                first = time.perf_counter()
        if index >= SKIPPED:
            ttfts.append((first - sent) * 1000)
    writer.close()
    return ttfts


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 600
    with tempfile.TemporaryDirectory() as logs:
        env = {"TAILCUT_SHED_NORMAL_WAITING": "0"}
        with tailcut_stack(MODEL_DIR, pathlib.Path(logs), env=env, worker_env=WORKER_ENV) as stack:
            ttfts = asyncio.run(measure(stack.url, count))
    ttfts.sort()
    print(f"TTFT ms median {statistics.median(ttfts):.3f} p90 {ttfts[int(0.9 * len(ttfts))]:.3f} n={len(ttfts)}")


if __name__ == "__main__":
    main()
