"""DeviceFeed: the device lists the kubelet sees, per resource, and when they change.

It joins the slice plan, the health board and the used slices into (id, health, NUMA node)
rows, and wakes ListAndWatch streams on the event loop when anything that feeds it changes.
Producers in other threads call `poke()`; streams `await wait(version)`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from deviceplugin.healthboard import HealthBoard, device_health
from deviceplugin.model import Health, SliceId
from deviceplugin.plan import SlicePlan


@dataclass(frozen=True)
class DeviceRow:
    id: SliceId
    health: Health
    numa_node: int | None


class DeviceFeed:
    def __init__(
        self,
        plan_source: Callable[[], SlicePlan],
        board: HealthBoard,
        used_source: Callable[[str], set[SliceId]],
    ) -> None:
        self._plan_source = plan_source
        self._board = board
        self._used_source = used_source
        self._lock = threading.Lock()
        self._version = 0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        board.subscribe(self.poke)

    @property
    def version(self) -> int:
        return self._version

    def poke(self) -> None:
        """Something changed (any thread): wake every waiting stream."""
        with self._lock:
            self._version += 1
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    async def wait(self, seen: int) -> int:
        """Return once the version differs from `seen`; returns the new version."""
        while True:
            event = asyncio.Event()
            with self._lock:
                if self._version != seen:
                    return self._version
                self._waiters.append((asyncio.get_running_loop(), event))
            await event.wait()

    def rows(self, resource: str) -> list[DeviceRow]:
        plan = self._plan_source()
        used = self._used_source(resource)
        rows: list[DeviceRow] = []
        for gpu_plan in plan.for_resource(resource):
            faults = self._board.faults(gpu_plan.uuid).keys()
            numa = gpu_plan.gpu.numa_node
            for device_id in gpu_plan.device_ids:
                health = device_health(gpu_plan.mode, faults, device_id in used)
                rows.append(DeviceRow(device_id, health, numa))
        return rows
