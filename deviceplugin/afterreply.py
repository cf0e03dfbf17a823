"""Work a gRPC handler may leave until its reply is on its way.

grpc.aio sends a unary reply from the handler's own loop callback (the send is started as the
handler returns), so a callback queued with `call_soon` runs once the bytes are written: log
lines, and pokes that wake other threads, which would otherwise take the GIL from the reply.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def after_reply(callback: Callable[[], object]) -> None:
    """Run `callback` after the event-loop callback running now; off a loop, at once."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        callback()
        return
    loop.call_soon(callback)
