"""SSE lines as the spec splits them: at CR, LF or CRLF only.

httpx's ``aiter_lines`` splits as ``str.splitlines`` does, also at U+2028, U+2029, U+0085, U+000B,
U+000C and U+001C–U+001E. JSON leaves those unescaped inside strings, and a model's tokens hold them
now and then: such a token cut its ``data:`` line in two, and the reader counted a well-formed stream as
an error (``JSONDecodeError: unexpected end of data``), against tailcut and vLLM's own server alike.
httpx-sse splits correctly but hands out whole events whose id is the last one seen (as a browser's
``EventSource`` does); the readers here check each frame's own ``id:`` line, so they read lines.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of ``response``'s body, without their line ends."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        if "\r" in pending:
            # A CR at the very end may be the first half of a CRLF: keep it for the next read.
            held = "\r" if pending.endswith("\r") else ""
            pending = pending.removesuffix(held).replace("\r\n", "\n").replace("\r", "\n") + held
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line
    if pending:
        yield pending.removesuffix("\r")
