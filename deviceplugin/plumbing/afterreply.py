"""Work a gRPC handler may leave until its reply is on its way.

grpc.aio sends a unary reply from the handler's own loop callback (the send is started as the
handler returns), so a callback queued with `call_soon` runs once the bytes are written: log
lines, and pokes that wake other threads, which would otherwise take the GIL from the reply.
A handler that works in a worker thread collects that thread's callbacks with `holding()` and
queues them on its loop once it has its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

Callback = Callable[[], object]

_held = threading.local()


def after_reply(callback: Callback) -> None:
    """Run `callback` after the event-loop callback running now, or, inside `holding()`,
    when the holder says; elsewhere at once."""
    pending: list[Callback] | None = getattr(_held, "callbacks", None)
    if pending is not None:
        pending.append(callback)
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        callback()
        return
    loop.call_soon(callback)


@contextlib.contextmanager
def holding() -> Iterator[list[Callback]]:
    """Collect this thread's `after_reply` callbacks into the list yielded, for the handler
    to pass to `after_reply` on its loop. Should the block raise, they run at once."""
    outer: list[Callback] | None = getattr(_held, "callbacks", None)
    pending: list[Callback] = []
    _held.callbacks = pending
    try:
        yield pending
    except BaseException:
        _held.callbacks = outer
        for callback in pending:
            callback()
        pending.clear()
        raise
    finally:
        _held.callbacks = outer
