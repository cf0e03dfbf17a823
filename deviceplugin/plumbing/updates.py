"""How state changes reach their watchers, for every front-end: `Changes` and `Pacer`.

`Changes` is a version counter that any thread bumps (`poke()`) and asyncio streams await
(`wait(seen)`); `Pacer` spaces sends to at most N a second. A watcher takes the state after
its pause, so a storm is coalesced and the last send always carries the final state.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

# The kubelet coalesces nothing: ListAndWatch updates, ResourceSlice republishes and health
# stream sends go out at most this often a second each.
MAX_UPDATES_PER_SECOND = 5


class Changes:
    """A version bumped from any thread; asyncio waiters on any loop are woken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = 0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def version(self) -> int:
        return self._version

    def poke(self) -> None:
        """Something changed (any thread): wake every waiter."""
        with self._lock:
            self._version += 1
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    async def wait(self, seen: int, timeout: float | None = None) -> int:
        """Return once the version differs from `seen` (or `timeout` passed): the version."""
        event = asyncio.Event()
        with self._lock:
            if self._version != seen:
                return self._version
            waiter = (asyncio.get_running_loop(), event)
            self._waiters.append(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
        finally:  # a stream cancelled while waiting leaves nothing behind
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
        return self._version


class Pacer:
    """At most `per_second` sends a second: `delay()` says how long to hold the next one."""

    def __init__(
        self,
        per_second: float = MAX_UPDATES_PER_SECOND,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gap = 1.0 / per_second
        self._clock = clock
        self._sent: float | None = None

    def delay(self) -> float:
        if self._sent is None:
            return 0.0
        return max(0.0, self.gap - (self._clock() - self._sent))

    def sent(self) -> None:
        self._sent = self._clock()
