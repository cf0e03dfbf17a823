"""Allocate answers, without gRPC or NVML.

`Allocator.allocate` validates device IDs, computes caps and ceilings, writes this
allocation's CDI spec, records the allocation in the ledger and returns a `Grant` the gRPC
server turns into a ContainerAllocateResponse. Refusals are `AllocationError`s whose codes name
gRPC statuses. GetPreferredAllocation's choice of IDs is `preferred.py`'s.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from deviceplugin import caps, grant_shape
from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.config.settings import Config
from deviceplugin.health.board import HealthBoard, device_health
from deviceplugin.ledger.record import AllocationRecord, Listing, key_of
from deviceplugin.ledger.store import Ledger
from deviceplugin.model import (
    FaultDomain,
    GpuUuid,
    Health,
    Mode,
    ResourceName,
    gpu_of,
)
from deviceplugin.mps.gate import MpsGate
from deviceplugin.plan import GpuPlan, SlicePlan
from deviceplugin.plumbing import logs
from deviceplugin.quantity import format_quantity

__all__ = [
    "AllocationError",
    "AllocationRecord",
    "Allocator",
    "CeilingDecision",
    "CeilingSource",
    "ErrorCode",
    "Grant",
    "MpsNotReady",
]

CONTROL_DEVICE_NODES = caps.CONTROL_DEVICE_NODES

_log = logs.get("allocator")


class ErrorCode(StrEnum):
    """Names of the gRPC status codes each refusal maps to (grpcerrors.status_for)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"


class AllocationError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class MpsNotReady(AllocationError):
    """The GPU's MPS daemon is being started; await `MpsGate.wait_ready` and retry once."""

    def __init__(self, gpu: GpuUuid) -> None:
        self.gpu = gpu
        super().__init__(ErrorCode.UNAVAILABLE, f"MPS daemon for {gpu} is not ready yet")


@dataclass(frozen=True)
class CeilingDecision:
    limit: int | None  # bytes, or None: no ceiling declared (limit = request)
    source: str | None  # e.g. "pod default/web container app"; None when nothing declared


class CeilingSource(Protocol):
    def ceiling_for(self, resource: ResourceName, count: int, gpu: GpuUuid) -> CeilingDecision: ...


Mount = caps.Mount
DeviceSpec = grant_shape.DeviceSpec


@dataclass(frozen=True)
class Grant:
    """One Allocate answer: its shape's shared fields, its own CDI device and its record."""

    shape: grant_shape.Shape
    own_device: str | None  # our CDI device for this allocation, qualified; None: none
    record: AllocationRecord

    @property
    def envs(self) -> dict[str, str]:
        return self.shape.envs

    @property
    def mounts(self) -> list[Mount]:
        return self.shape.mounts

    @property
    def device_specs(self) -> list[DeviceSpec]:
        return self.shape.device_specs

    @property
    def annotations(self) -> dict[str, str]:
        return self.shape.annotations

    @property
    def cdi_devices(self) -> list[str]:
        """Fully qualified CDI device names: the driver's, then ours."""
        own = [] if self.own_device is None else [self.own_device]
        return [*self.shape.driver_devices, *own]


# A refusal names at most this many IDs: gRPC carries the message in a trailer the client
# drops above 16 KiB, and one log line per refusal should stay readable.
MAX_IDS_IN_MESSAGE = 8


def _some(ids: Sequence[str]) -> str:
    shown = [d[:80] for d in ids[:MAX_IDS_IN_MESSAGE]]
    more = len(ids) - len(shown)
    return f"{shown} and {more} more" if more > 0 else str(shown)


# ---------------------------------------------------------------------------------------------
# Allocate


def largest_free(
    plan: SlicePlan, board: HealthBoard, used: Collection[str], resource: str
) -> tuple[int, GpuPlan | None]:
    """The most healthy free slices of `resource` on one GPU, and that GPU: the largest
    request that fits now, which makes fragmentation visible in refusals and Events."""
    best: tuple[int, GpuPlan | None] = (0, None)
    for gp in plan.for_resource(resource):
        if device_health(gp.mode, board.faults(gp.uuid), allocated=False) is not Health.HEALTHY:
            continue
        free = sum(1 for d in gp.device_ids if d not in used)
        if free > best[0]:
            best = (free, gp)
    return best


class Allocator:
    def __init__(
        self,
        plan_source: Callable[[], SlicePlan],
        config_source: Callable[[], Config],
        cdi_dir: Path,
        mps_root: Path,
        ledger: Ledger,
        board: HealthBoard,
        mps: MpsGate | None = None,
        ceilings: CeilingSource | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._plan = plan_source
        self._config = config_source
        self._cdi_dir = cdi_dir
        self._mps_root = mps_root
        self._ledger = ledger
        self._board = board
        self._mps = mps
        self._ceilings = ceilings
        self._shapes = grant_shape.ShapeCache[grant_shape.Shape]()

    # -- refusals -------------------------------------------------------------------------

    def _validate(
        self, plan: SlicePlan, resource: str, device_ids: Sequence[str]
    ) -> tuple[list[GpuPlan], Mode]:
        if not device_ids:
            raise AllocationError(ErrorCode.INVALID_ARGUMENT, "empty device list")
        if len(set(device_ids)) != len(device_ids):
            dupes = sorted(d for d, n in Counter(device_ids).items() if n > 1)
            raise AllocationError(
                ErrorCode.INVALID_ARGUMENT, f"repeated device IDs: {_some(dupes)}"
            )
        gpus: dict[str, GpuPlan] = {}
        unknown: list[str] = []
        foreign: list[str] = []
        for d in device_ids:
            gp = plan.for_gpu(gpu_of(d))
            if gp is None or not gp.device_plugin or d not in gp.id_set:
                unknown.append(d)
            elif gp.resource != resource:
                foreign.append(f"{d} ({gp.resource})")
            else:
                gpus.setdefault(gp.uuid, gp)
        if unknown:
            raise AllocationError(
                ErrorCode.INVALID_ARGUMENT, f"unknown device IDs: {_some(unknown)}"
            )
        if foreign:
            raise AllocationError(
                ErrorCode.INVALID_ARGUMENT,
                f"device IDs of another resource than {resource}: {_some(foreign)}",
            )
        plans = list(gpus.values())
        mode = plans[0].mode
        if mode is not Mode.EXCLUSIVE and len(plans) > 1:
            raise AllocationError(
                ErrorCode.FAILED_PRECONDITION, self._spread_message(plan, resource, device_ids)
            )
        return plans, mode

    def _spread_message(self, plan: SlicePlan, resource: str, device_ids: Sequence[str]) -> str:
        counts: dict[str, int] = {}
        for d in device_ids:
            counts[gpu_of(d)] = counts.get(gpu_of(d), 0) + 1
        spread = ", ".join(f"{g} ({n})" for g, n in counts.items())
        n, best = largest_free(plan, self._board, self._ledger.used_ids(resource), resource)
        fit = "no GPU has a free slice now"
        if best is not None and n > 0:
            gp = best
            fit = (
                f"the largest request that fits on one GPU now is {n} slices "
                f"({format_quantity(n * gp.slice_size)}) on {gp.uuid}"
            )
        return f"{resource} slices must come from one GPU; this request spans {spread}; {fit}"

    # -- answers --------------------------------------------------------------------------

    def allocate(self, resource: str, device_ids: Sequence[str]) -> Grant:
        plan = self._plan()
        config = self._config()
        plans, mode = self._validate(plan, resource, list(device_ids))
        key = key_of(device_ids)
        name = cdi_specs.device_name(key)
        existing = self._ledger.get(key)
        if mode is Mode.SM_SHARING:
            gpu = plans[0].uuid
            live = self._ledger.live_count(gpu, Mode.SM_SHARING)
            if existing is None and live >= config.mps.max_clients:
                raise AllocationError(
                    ErrorCode.RESOURCE_EXHAUSTED,
                    f"{gpu} already has {live} sm-sharing allocations (mps.maxClients "
                    f"{config.mps.max_clients})",
                )
            if self._mps is not None and not self._mps.ensure(gpu):
                raise MpsNotReady(gpu)
        # The same devices again start a fresh record (new time, not yet listed): the kubelet
        # may have handed them to a new container before we saw the last one go.
        created = self._clock()
        shape = self._shape(plan, config, resource, plans, len(key), name)
        grant = self._grant(shape, resource, key, name, created, existing)
        self._ledger.add(grant.record)
        if mode is Mode.SM_SHARING:
            self._update_client_limit(plans[0].uuid, config.mps.max_clients)
        logs.log_soon(
            _log,
            "allocated",
            resource=resource,
            gpu=",".join(grant.record.gpus),
            devices=len(key),
            request_mib=grant.record.request_mib,
            limit_mib=grant.record.limit_mib,
            enforcement=",".join(grant.record.enforcement) or "-",
            delivery=grant.record.delivery,
            reused=existing is not None,
        )
        return grant

    def _shape(
        self,
        plan: SlicePlan,
        config: Config,
        resource: str,
        plans: list[GpuPlan],
        count: int,
        name: str,
    ) -> grant_shape.Shape:
        digit = name[0].isdigit()  # such a name needs a later cdiVersion
        if plans[0].mode is Mode.EXCLUSIVE:
            gpus = tuple(plans)
            return self._shapes.get(
                plan,
                config,
                ("exclusive", tuple(g.uuid for g in gpus), digit),
                lambda: grant_shape.exclusive(config, gpus, name),
            )
        gp = caps.reclaimable(plans[0], self._mps.memory_accounting if self._mps else None)
        decision = CeilingDecision(None, None)
        if self._ceilings is not None:
            decision = self._ceilings.ceiling_for(ResourceName(resource), count, gp.uuid)
        limit, source = decision.limit, decision.source
        return self._shapes.get(
            plan,
            config,
            (gp.uuid, count, gp.reclaimable, limit, source, digit),
            lambda: grant_shape.fractional(config, gp, self._mps_root, count, limit, source, name),
        )

    def _grant(
        self,
        shape: grant_shape.Shape,
        resource: str,
        key: tuple[str, ...],
        name: str,
        created: float,
        held: AllocationRecord | None,
    ) -> Grant:
        """The answer and its record; `name`: the CDI device name of `key`; `held`: the
        ledger's record of the same devices, if any (its spec body spares rewriting an
        unchanged spec)."""
        own_device: str | None = None
        spec_file: str | None = None
        spec: Mapping[str, Any] | None = None
        spec_text: str | None = None
        built = shape.spec(name)
        if built is not None:
            if held is not None and held.cdi_json is not None and held.cdi_body == built:
                spec, spec_text = held.cdi_body, held.cdi_json  # the same again
                path = cdi_specs.write_spec(self._cdi_dir, spec, known=spec, text=spec_text)
            else:
                # No record of these devices (`held` None): no file of ours to compare, and
                # reading for one costs a failed open and its exception per new Allocate.
                spec, spec_text = built, shape.spec_text(name)
                path = cdi_specs.write_spec(
                    self._cdi_dir, spec, text=spec_text, checked=True, new=held is None
                )
            spec_file = str(path)
            own_device = cdi_specs.qualified(cdi_specs.KIND, name)
        request_mib, limit_mib, enforcement, source, policy = shape.record_fields
        record = AllocationRecord(
            device_ids=key,  # type: ignore[arg-type]  # sorted slice IDs, validated
            resource=resource,
            gpus=shape.gpus,
            mode=shape.mode,
            request_mib=request_mib,
            limit_mib=limit_mib,
            enforcement=enforcement,
            delivery=shape.delivery,
            ceiling_source=source,
            ceiling_policy=policy,
            cdi_spec=spec_file,
            created=created,
            cdi_body=spec,
            cdi_json=spec_text,
        )
        return Grant(shape=shape, own_device=own_device, record=record)

    # -- client limit and reconciliation --------------------------------------------------

    def _update_client_limit(self, gpu: GpuUuid, max_clients: int) -> None:
        live = self._ledger.live_count(gpu, Mode.SM_SHARING)
        if live >= max_clients:
            self._board.set(gpu, FaultDomain.CLIENT_LIMIT, f"clients={live} max={max_clients}")
        else:
            self._board.clear(gpu, FaultDomain.CLIENT_LIMIT)

    def refresh_client_limits(self) -> None:
        """Re-evaluate the client-limit fault of every sm-sharing GPU (after reconcile/reload)."""
        max_clients = self._config().mps.max_clients
        for gp in self._plan().gpus:
            if gp.mode is Mode.SM_SHARING:
                self._update_client_limit(gp.uuid, max_clients)
            else:
                self._board.clear(gp.uuid, FaultDomain.CLIENT_LIMIT)

    def reconcile(self, listing: Listing) -> list[AllocationRecord]:
        """Forget allocations the kubelet no longer holds (deleting their CDI specs)."""
        gone = self._ledger.reconcile(listing)
        if gone:
            self.refresh_client_limits()
        return gone
