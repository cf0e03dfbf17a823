"""DeviceFeed: the device lists the kubelet sees, per resource, and when they change.

It joins the slice plan, the health board and the used slices into (id, health, NUMA node)
rows, and wakes ListAndWatch streams on the event loop when anything that feeds it changes.
Producers in other threads call `poke()`; streams `await wait(version)`. `encoded()` gives
the serialized ListAndWatchResponse, built from per-GPU pieces cached by what decides their
health, so a fault on one GPU re-encodes that GPU's devices only.
"""

from __future__ import annotations

from collections.abc import Callable

from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb
from deviceplugin.health.board import HealthBoard, device_health
from deviceplugin.health.verdicts import DEFAULT_BOUND, Verdicts
from deviceplugin.model import FaultDomain, SliceId
from deviceplugin.mps.supervisor import STARTING
from deviceplugin.plan import GpuPlan, SlicePlan
from deviceplugin.plumbing.updates import Changes

# What decides one GPU's piece: its plan, its fault domains, and (only under a client limit,
# where free and allocated slices differ) which of its slices are allocated.
PieceKey = tuple[frozenset[FaultDomain], frozenset[str] | None]


class DeviceFeed:
    def __init__(
        self,
        plan_source: Callable[[], SlicePlan],
        board: HealthBoard,
        used_source: Callable[[str], set[SliceId]],
        verdict_bound: float = DEFAULT_BOUND,
    ) -> None:
        self._plan_source = plan_source
        self._board = board
        self._used_source = used_source
        self._changes = Changes()
        # An MPS daemon not yet judged (first bring-up, or adoption after a restart) is not a
        # fault the kubelet hears of, within a bound (health/verdicts.py).
        self._verdicts = Verdicts(self.poke, verdict_bound)
        self._pieces: dict[str, tuple[GpuPlan, PieceKey, bytes]] = {}  # by GPU UUID
        board.subscribe(self.poke)

    @property
    def version(self) -> int:
        return self._changes.version

    def poke(self) -> None:
        """Something changed (any thread): wake every waiting stream."""
        self._changes.poke()

    def close(self) -> None:
        """Cancel the verdicts' timers (the daemon's stop)."""
        self._verdicts.stop()

    async def wait(self, seen: int) -> int:
        """Return once the version differs from `seen`; returns the new version."""
        while True:
            version = await self._changes.wait(seen)
            if version != seen:
                return version

    def encoded(self, resource: str) -> bytes:
        """The serialized ListAndWatchResponse for `resource` (repeated fields concatenate)."""
        plan = self._plan_source()
        used: set[SliceId] | None = None
        pieces: list[bytes] = []
        for gp in plan.for_resource(resource):
            held = self._board.faults(gp.uuid)
            starting = held.get(FaultDomain.MPS_DAEMON)
            faults = frozenset(held)
            if self._verdicts.waiting(gp.uuid, starting is not None and starting.cause == STARTING):
                faults -= {FaultDomain.MPS_DAEMON}
            allocated: frozenset[str] | None = None
            if FaultDomain.CLIENT_LIMIT in faults:
                used = self._used_source(resource) if used is None else used
                allocated = gp.id_set & used
            key: PieceKey = (faults, allocated)
            cached = self._pieces.get(gp.uuid)
            if cached is None or cached[0] is not gp or cached[1] != key:
                cached = (gp, key, _encode(gp, faults, allocated or frozenset()))
                self._pieces[gp.uuid] = cached
            pieces.append(cached[2])
        return b"".join(pieces)


def _encode(gp: GpuPlan, faults: frozenset[FaultDomain], allocated: frozenset[str]) -> bytes:
    numa = gp.gpu.numa_node
    topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=numa)]) if numa is not None else None
    devices = [
        pb.Device(
            ID=device_id,
            health=device_health(gp.mode, faults, device_id in allocated).value,
            topology=topology,
        )
        for device_id in gp.device_ids
    ]
    encoded: bytes = pb.ListAndWatchResponse(devices=devices).SerializeToString()
    return encoded
