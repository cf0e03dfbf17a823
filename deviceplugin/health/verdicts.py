"""Verdicts: which sm-sharing devices still wait for their MPS daemon's first verdict.

A domain not yet judged is never shown as faulted: while a daemon's first bring-up runs (the
supervisor's `daemon-starting`), a DRA device keeps what the pool holds, or waits to be
published, and the device-plugin API keeps listing its slices Healthy (Allocate waits for the
daemon). The real kubelet refuses to admit a pod whose devices it was last told are Unhealthy,
so a restart that listed them so would fail the pods the scheduler placed meanwhile. Each wait
is bounded; when the bound expires that is the verdict (the daemon did not come up in time)
and `on_expiry` asks for the lists again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from deviceplugin.model import FaultDomain

DEFAULT_BOUND = 30.0  # seconds a device may wait for its daemon's first verdict
# The MPS_DAEMON cause the supervisor sets while a daemon's first bring-up runs: no verdict yet.
STARTING = "daemon-starting"


def unjudged(domain: FaultDomain, cause: str) -> bool:
    """Whether a fault is no verdict yet (its MPS daemon's first bring-up runs)."""
    return domain is FaultDomain.MPS_DAEMON and cause == STARTING


class Verdicts:
    """`waiting(name, unjudged)` per device, from any thread; `stop()` cancels the timers."""

    def __init__(
        self,
        on_expiry: Callable[[], None],
        bound: float = DEFAULT_BOUND,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_expiry = on_expiry
        self._bound = bound
        self._clock = clock
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}  # device → when it was first seen unjudged
        self._timers: list[threading.Timer] = []
        self._stopped = False

    def waiting(self, name: str, unjudged: bool) -> bool:
        """True while `name` is unjudged and within its bound. Judged once, a device starts a
        fresh bound only when it is unjudged again (a GPU newly given to sm-sharing)."""
        now = self._clock()
        with self._lock:
            if not unjudged:
                self._since.pop(name, None)
                return False
            since = self._since.get(name)
            if since is None:
                self._since[name] = since = now
                if not self._stopped:
                    timer = threading.Timer(self._bound + 0.05, self._on_expiry)  # after, not at
                    timer.daemon = True
                    timer.start()
                    self._timers = [t for t in self._timers if t.is_alive()] + [timer]
            return now - since < self._bound

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            timers, self._timers = self._timers, []
        for timer in timers:
            timer.cancel()
