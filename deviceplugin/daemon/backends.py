"""What the daemon hands its servers: the gRPC servers' backend and observer, the metrics' feed.

`AllocationService` answers GetPreferredAllocation and Allocate from the current plan and the
allocator; `DaemonObserver` takes the servers' latencies and refusals to the metrics and the
pods; `MetricsFeed` builds what the metrics read at scrape time (slices per state, memory per
allocation) and follows the MPS supervisor's restarts and probe latency. `cause_class` bounds
a health transition's cause to a metric label.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from deviceplugin.dpapi.allocator import Allocator, Grant, largest_free
from deviceplugin.dpapi.podresources import ContainerDevices
from deviceplugin.dpapi.preferred import preferred
from deviceplugin.health.board import HealthBoard, device_health
from deviceplugin.inventory.nvml import NvmlSession
from deviceplugin.ledger.store import Ledger
from deviceplugin.metrics.families import AllocationMemory, PluginMetrics, SliceCount
from deviceplugin.model import MIB, GpuUuid, ResourceName
from deviceplugin.mps.gate import MpsGate
from deviceplugin.mps.supervisor import MpsSupervisor
from deviceplugin.plan import SlicePlan
from deviceplugin.plumbing.afterreply import after_reply


def cause_class(cause: str) -> str:
    """A bounded metric label for a cause: `xid=79 class=reboot` → `reboot`, `daemon-dead
    pid=7` → `daemon-dead`, `mps-state=FAULT server=9` → `mps-state`."""
    for part in cause.split():
        if part.startswith("class="):
            return part.removeprefix("class=")
    return cause.split(" ", 1)[0].split("=", 1)[0] or "unknown"


class AllocationService:
    """The gRPC servers' backend: the allocator plus latency and refusal bookkeeping."""

    def __init__(
        self,
        plan: Callable[[], SlicePlan],
        allocator: Allocator,
        mps: MpsGate,
        after_allocate: Callable[[], None],
    ) -> None:
        self._plan = plan
        self._allocator = allocator
        self._mps = mps
        self._after_allocate = after_allocate

    def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        return list(preferred(self._plan(), resource, available, must_include, size))

    def allocate(self, resource: str, device_ids: Sequence[str]) -> Grant:
        grant = self._allocator.allocate(resource, device_ids)
        after_reply(self._after_allocate)  # it wakes the pod-resources poll
        return grant

    def wait_mps(self, gpu: GpuUuid, timeout: float) -> bool:
        return self._mps.wait_ready(gpu, timeout)


class DaemonObserver:
    """What the gRPC servers report: latencies and refusals to metrics, refusals to the pods."""

    def __init__(
        self,
        metrics: PluginMetrics,
        kube: Any,
        plan: Callable[[], SlicePlan],
        ledger: Ledger,
        board: HealthBoard,
    ) -> None:
        self._metrics = metrics
        self._kube = kube
        self._plan = plan
        self._ledger = ledger
        self._board = board

    def allocate_latency(self, resource: str, seconds: float) -> None:
        self._metrics.allocate_latency(resource, seconds)

    def preferred_latency(self, resource: str, seconds: float) -> None:
        self._metrics.preferred_latency(resource, seconds)

    def refused(self, resource: str, reason: str, count: int = 0, message: str = "") -> None:
        self._metrics.refused(resource, reason)
        if self._kube is not None:
            used = self._ledger.used_ids(resource)
            fit, _ = largest_free(self._plan(), self._board, used, resource)
            self._kube.on_refused(ResourceName(resource), count, message or reason, fit)


class MetricsFeed:
    """What the metrics read of the node: slice counts and allocation memory at scrape time,
    the MPS daemons' restarts and probe latency as the supervisor sees them."""

    def __init__(
        self,
        plan: Callable[[], SlicePlan],
        ledger: Ledger,
        board: HealthBoard,
        session: NvmlSession,
        mps: MpsSupervisor,
        metrics: PluginMetrics,
    ) -> None:
        self._plan = plan
        self._ledger = ledger
        self._board = board
        self._session = session
        self._mps = mps
        self._metrics = metrics
        self._holders: dict[tuple[str, ...], tuple[str, str, str]] = {}
        self._mps_restarts_seen: dict[GpuUuid, int] = {}

    def slice_counts(self) -> list[SliceCount]:
        counts: dict[tuple[str, str, str, str], int] = {}
        for gp in self._plan().gpus:
            if not gp.device_plugin:
                continue
            used = self._ledger.used_ids(gp.resource)
            faults = self._board.faults(gp.uuid).keys()
            for device in gp.device_ids:
                allocated = device in used
                health = device_health(gp.mode, faults, allocated).value
                key = (gp.resource, gp.uuid, health, "allocated" if allocated else "free")
                counts[key] = counts.get(key, 0) + 1
        return [SliceCount(r, g, h, s, n) for (r, g, h, s), n in sorted(counts.items())]

    def remember_holders(self, listed: list[ContainerDevices]) -> bool:
        self._holders = {
            tuple(sorted(c.device_ids)): (c.namespace, c.pod, c.container) for c in listed
        }
        return False  # nothing here needs the fast poll

    def allocation_memory(self) -> list[AllocationMemory]:
        """Memory used per allocation where NVML can tell: on a GPU with one allocation, the
        GPU's processes are that allocation's (NVML names processes, not containers)."""
        records = self._ledger.records()
        per_gpu: dict[GpuUuid, int] = {}
        for record in records:
            per_gpu[record.gpu] = per_gpu.get(record.gpu, 0) + 1
        out: list[AllocationMemory] = []
        for record in records:
            used: int | None = None
            if per_gpu[record.gpu] == 1:
                try:
                    procs = self._session.running_processes(record.gpu)
                    used = sum(p.used_memory or 0 for p in procs)
                except Exception:  # a lost GPU or an old driver: unknown, not zero
                    used = None
            ns, pod, container = self._holders.get(record.key, ("", "", ""))
            limit = (record.limit_mib or 0) * MIB
            out.append(
                AllocationMemory(record.resource, record.gpu, ns, pod, container, used, limit)
            )
        return out

    async def follow_mps(self, every: float = 2.0) -> None:
        """MPS restarts and probe latency into metrics, from the supervisor's snapshots."""
        while True:
            for gpu, snap in self._mps.snapshot().items():
                seen = self._mps_restarts_seen.get(gpu, 0)
                for _ in range(max(0, snap.restarts - seen)):
                    self._metrics.mps_restart(gpu)
                self._mps_restarts_seen[gpu] = snap.restarts
                if snap.last_probe_latency is not None:
                    self._metrics.mps_probe_latency(gpu, snap.last_probe_latency)
            await asyncio.sleep(every)
