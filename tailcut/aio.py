"""The worker's event loop: uvloop where it imports (it comes with ``uvicorn[standard]``, and the
API's server runs on it already), else asyncio's own.

uvloop wakes tasks, resolves futures and writes sockets several times cheaper than asyncio's
selector loop, and a worker does all three for every token it streams. vLLM's own server runs its
``AsyncLLM`` on uvloop the same way. The jobs process (arq) stays on asyncio's loop: it streams no
tokens, and its shutdown is tested there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory, or None (asyncio's default loop) where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coroutine)`` on the loop of ``loop_factory``."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coroutine)
