"""``tailcut.processes.exit_without_a_last_collection``: what a process holding torch and vLLM skips at exit."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A cycle with a finaliser, left for the collector (automatic collection off, so only the interpreter's
# last collection at exit can find it), and a log line that must still be flushed at exit.
PROGRAM = """
import gc, logging, sys
from tailcut.processes import exit_without_a_last_collection
gc.disable()
logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.INFO)
class Cycle:
    def __del__(self):
        print("collected", flush=True)
cycle = Cycle()
cycle.itself = cycle
del cycle
if sys.argv[1] == "skip":
    exit_without_a_last_collection()
logging.getLogger("t").info("logged")
"""


@pytest.mark.parametrize(("mode", "collected"), [("skip", False), ("keep", True)])
def test_a_process_exits_without_the_interpreters_last_collection(mode: str, collected: bool) -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("collected" in done.stdout) is collected, done.stdout
    assert "logged" in done.stdout
