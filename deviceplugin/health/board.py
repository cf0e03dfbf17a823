"""HealthBoard: the faults currently held against each GPU, by fault domain.

Producers (health monitor, MPS supervisor, allocator's client limit) set and clear faults;
the gRPC servers turn them into per-device health with `device_health`. Thread-safe:
producers run in threads, listeners are told after every change.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from deviceplugin.model import (
    GPU_WIDE_DOMAINS,
    MPS_DOMAINS,
    FaultDomain,
    GpuUuid,
    Health,
    Mode,
)


@dataclass(frozen=True)
class Fault:
    domain: FaultDomain
    cause: str  # e.g. "xid=79 class=reboot", "mps-state=FAULT", "daemon-dead"
    since: float  # wall-clock seconds


Listener = Callable[[], None]


class HealthBoard:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._faults: dict[GpuUuid, dict[FaultDomain, Fault]] = {}
        self._listeners: list[Listener] = []
        self._clock = clock
        self.version = 0

    def set(self, gpu: GpuUuid, domain: FaultDomain, cause: str) -> bool:
        """Record a fault; returns True when the board changed (a new fault or a new cause)."""
        with self._lock:
            current = self._faults.get(gpu, {}).get(domain)
            if current is not None and current.cause == cause:
                return False
            since = current.since if current is not None else self._clock()
            self._faults.setdefault(gpu, {})[domain] = Fault(domain, cause, since)
            self.version += 1
        self._notify()
        return True

    def clear(self, gpu: GpuUuid, domain: FaultDomain) -> bool:
        with self._lock:
            domains = self._faults.get(gpu)
            if not domains or domain not in domains:
                return False
            del domains[domain]
            if not domains:
                del self._faults[gpu]
            self.version += 1
        self._notify()
        return True

    def faults(self, gpu: GpuUuid) -> dict[FaultDomain, Fault]:
        with self._lock:
            return dict(self._faults.get(gpu, {}))

    def snapshot(self) -> dict[GpuUuid, dict[FaultDomain, Fault]]:
        with self._lock:
            return {g: dict(d) for g, d in self._faults.items()}

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()


def device_health(mode: Mode, faults: Collection[FaultDomain], allocated: bool) -> Health:
    """Health of one device of a GPU in `mode` given the GPU's fault domains (DESIGN section 5)."""
    if any(d in GPU_WIDE_DOMAINS for d in faults):
        return Health.UNHEALTHY
    if mode is Mode.SM_SHARING:
        if any(d in MPS_DOMAINS for d in faults):
            return Health.UNHEALTHY
        if FaultDomain.CLIENT_LIMIT in faults and not allocated:
            return Health.UNHEALTHY
    return Health.HEALTHY
