"""What a claim's results become before anything is written (DESIGN section 10): per result
its GPU, the bytes it is charged, its ceiling, its CDI device and its checkpoint entry, and
the claim's CDI spec.

Caps come from `caps` exactly as Allocate's do. What every result of one shape shares (GPU,
request, ceiling decision, thread share) is worked out and checked against the CDI rules once
per shape (`grant_shape.ShapeCache`): the kubelet prepares the same few claim shapes over and
over (one ResourceClaimTemplate's request), and the 8-claim prepare's reply waits on each.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deviceplugin import caps, grant_shape
from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.config.settings import Config
from deviceplugin.dra import slices
from deviceplugin.dra.checkpoint import ClaimEntry, DeviceEntry
from deviceplugin.dra.results import ClaimError, Result, share_config
from deviceplugin.model import MIB, GpuUuid, Mode
from deviceplugin.mps.gate import MpsGate
from deviceplugin.plan import GpuPlan, SlicePlan
from deviceplugin.quantity import format_quantity

MPS_READY_TIMEOUT = 10.0  # well inside the kubelet's 45 s per call


@dataclass(frozen=True)
class Planned:
    """One result, its GPU, its entry and its CDI device's edits, before anything is written."""

    result: Result
    gp: GpuPlan
    entry: DeviceEntry
    cdi_edits: dict[str, Any] | None  # our CDI device's containerEdits; None: the driver's only
    cdi_version: str


@dataclass(frozen=True)
class _Shape:
    """What every result of one shape shares (read only: shared by every claim of it)."""

    gp: GpuPlan  # as `caps.reclaimable` judged it
    limit_mib: int | None
    enforcement: tuple[str, ...]
    ceiling_policy: str | None
    cdi_edits: dict[str, Any] | None
    cdi_version: str


@dataclass
class Tally:
    """Per GPU: bytes prepared (admin access is charged nothing) and sm-sharing shares."""

    used: dict[str, int] = field(default_factory=dict)
    shares: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, entries: Sequence[ClaimEntry]) -> Tally:
        tally = cls()
        for entry in entries:
            tally.add(entry.devices)
        return tally

    def add(self, devices: Sequence[DeviceEntry], sign: int = 1) -> None:
        for d in devices:
            if not d.admin_access:
                self.used[d.gpu] = self.used.get(d.gpu, 0) + sign * d.request_bytes
                if d.mode == Mode.SM_SHARING.value:
                    self.shares[d.gpu] = self.shares.get(d.gpu, 0) + sign

    def remove(self, devices: Sequence[DeviceEntry]) -> None:
        self.add(devices, -1)

    def copy(self) -> Tally:
        return Tally(dict(self.used), dict(self.shares))


class ClaimPlanner:
    """Plans claims against one node's DRA GPUs; the caller serialises calls per GPU (the
    Preparer holds each GPU a claim plans on)."""

    def __init__(self, node_name: str, driver: str, mps: MpsGate | None, mps_root: Path) -> None:
        self._node_name = node_name
        self._driver = driver
        self._mps = mps
        self._mps_root = mps_root
        self._shapes = grant_shape.ShapeCache[_Shape]()
        self._shapes_lock = threading.Lock()  # claims on different GPUs plan at once
        self._by_name: tuple[SlicePlan | None, dict[str, GpuPlan]] = (None, {})

    def gpus(self, plan: SlicePlan, results: Sequence[Result]) -> list[str]:
        """The UUIDs of the GPUs `results` name (a device no DRA GPU of ours: ClaimError)."""
        return [self._gpu(plan, r.device).uuid for r in results]

    def plan(
        self,
        uid: str,
        claim: dict[str, Any],
        results: Sequence[Result],
        config: Config,
        plan: SlicePlan,
        tally: Tally,
    ) -> list[Planned]:
        """The claim's results planned against `tally` (what other claims and the earlier
        results hold), which it updates; raises ClaimError, leaving `tally` part-updated
        (the caller plans against a copy)."""
        one_container(claim, [(r, self._gpu(plan, r.device)) for r in results])
        planned: list[Planned] = []
        for k, r in enumerate(results):
            gp = self._gpu(plan, r.device)
            request = (
                gp.usable
                if gp.mode is Mode.EXCLUSIVE or r.consumed_memory is None
                else r.consumed_memory
            )
            if not r.admin_access:
                self._check_capacity(gp, r, request, tally.used.get(gp.uuid, 0))
                if gp.mode is Mode.SM_SHARING:
                    live = tally.shares.get(gp.uuid, 0)
                    if live >= config.mps.max_clients:
                        raise ClaimError(
                            f"{r.device} ({gp.uuid}) already has {live} sm-sharing claims "
                            f"prepared (mps.maxClients {config.mps.max_clients})"
                        )
            one = self._plan_one(uid, claim, r, k, gp, request, config, plan)
            tally.add((one.entry,))
            planned.append(one)
        same_caps(claim, planned)
        return planned

    def _gpu(self, plan: SlicePlan, device: str) -> GpuPlan:
        known, by_name = self._by_name
        if known is not plan:
            by_name = {slices.device_name(gp): gp for gp in plan.dra_gpus}
            self._by_name = (plan, by_name)
        gp = by_name.get(device)  # the name the published slice gave it
        if gp is None:
            raise ClaimError(f"device {device} is not a DRA GPU of node {self._node_name}")
        return gp

    def _check_capacity(self, gp: GpuPlan, r: Result, request: int, used: int) -> None:
        if used + request <= gp.usable:
            return
        raise ClaimError(
            f"{r.device} ({gp.uuid}) would be prepared beyond its capacity: "
            f"{format_quantity(used)} of {format_quantity(gp.usable)} already prepared, "
            f"request {r.request} asks {format_quantity(request)}"
        )

    def _plan_one(
        self,
        uid: str,
        claim: dict[str, Any],
        r: Result,
        k: int,
        gp: GpuPlan,
        request: int,
        config: Config,
        plan: SlicePlan,
    ) -> Planned:
        name = f"{uid}-{r.device}-{k}"
        driver_device = grant_shape.driver_device(config, gp)  # ours on GPU Operator nodes
        if gp.mode is Mode.EXCLUSIVE or r.admin_access:
            # The driver's device is all a whole GPU needs; a device of ours would carry no
            # edits, which the CDI library refuses (the container would not start).
            ids: tuple[str, ...] = (driver_device,)
            shape = _Shape(gp, None, (), None, None, "")
            source = None
        else:
            if not cdi_specs.valid_name(name):  # a UID no API server would give
                raise ClaimError(f"claim UID {uid!r} makes no valid CDI device name")
            ids = (driver_device, cdi_specs.qualified(cdi_specs.CLAIM_KIND, name))
            share = share_config(claim, self._driver, r.request)
            if gp.mode is Mode.SM_SHARING:  # reclaim needs the running daemon's proof
                self._ensure_mps(gp.uuid)
                gp = caps.reclaimable(gp, self._mps.memory_accounting if self._mps else None)
            threads = caps.proportional_threads(
                share.active_thread_percentage
                if share.active_thread_percentage is not None
                else config.mps.active_thread_percentage,
                request,
                gp.usable,
            )
            declared, source = share.memory_limit, share.source
            # The ceiling's source goes into the entry only; the edits depend on whether one
            # was declared, and a name's first character on the spec's version.
            key = (gp.uuid, gp.reclaimable, request, declared, threads, name[:1].isdigit())
            with self._shapes_lock:
                shape = self._shapes.get(
                    plan,
                    config,
                    key,
                    lambda: self._fractional(config, gp, request, declared, threads, name),
                )
        entry = DeviceEntry(
            request=r.request,
            pool=r.pool,
            device=r.device,
            gpu=gp.uuid,
            mode=gp.mode.value,
            share_id=r.share_id,
            request_bytes=request,
            limit_mib=shape.limit_mib,
            enforcement=shape.enforcement,
            ceiling_source=source,
            ceiling_policy=shape.ceiling_policy,
            cdi_device_ids=ids,
            admin_access=r.admin_access,
        )
        return Planned(r, shape.gp, entry, shape.cdi_edits, shape.cdi_version)

    def _fractional(
        self,
        config: Config,
        gp: GpuPlan,
        request: int,
        declared: int | None,
        threads: int | None,
        name: str,
    ) -> _Shape:
        ceiling = caps.apply_ceiling(config, gp, request, declared, None)
        edits = caps.fractional_edits(config, gp, self._mps_root, request, ceiling, threads)
        cdi_edits, version = grant_shape.checked_cdi_edits(edits, name, cdi_specs.CLAIM_KIND)
        return _Shape(
            gp, ceiling.limit // MIB, tuple(gp.enforcement), ceiling.policy, cdi_edits, version
        )

    def _ensure_mps(self, gpu: GpuUuid) -> None:
        if self._mps is None:
            return
        if not self._mps.ensure(gpu) and not self._mps.wait_ready(gpu, MPS_READY_TIMEOUT):
            raise ClaimError(f"MPS daemon for {gpu} is not ready yet")


def _where(claim: dict[str, Any]) -> str:
    meta = claim.get("metadata") or {}
    return f"ResourceClaim {meta.get('namespace')}/{meta.get('name')}"


def one_container(claim: dict[str, Any], results: Sequence[tuple[Result, GpuPlan]]) -> None:
    """An sm-sharing device must be its claim's only device: a container that names the
    claim gets every device of it, a CUDA client reaches one MPS control daemon (one
    CUDA_MPS_PIPE_DIRECTORY), and real CDI keeps one value of each variable and one mount
    at /dev/shm (container-device-interface `ContainerEdits.Apply`), so a second GPU would be
    out of reach or its caps lost. Refused before any daemon is waited for."""
    shared = [r for r, gp in results if gp.mode is Mode.SM_SHARING and not r.admin_access]
    if not shared or len(results) == 1:
        return
    others = ", ".join(
        f"{r.device} (request {r.request})" for r, _ in results if r is not shared[0]
    )
    raise ClaimError(
        f"{_where(claim)}: sm-sharing device {shared[0].device} (request {shared[0].request}) "
        f"must be the claim's only device, but it has {others}: a container gets exactly one "
        "sm-sharing GPU (one MPS control daemon per client); use one claim per sm-sharing "
        "GPU and container"
    )


def same_caps(claim: dict[str, Any], planned: Sequence[Planned]) -> None:
    """Time-slicing shares of one claim must carry the same request and limit: the memory
    hook of each GPU reads one NVIDIA_GPU_MEMORY_REQUEST/LIMIT pair from the container's
    environment, and with several of our devices in a container CDI keeps the last value,
    so different amounts cannot reach their GPUs (refused rather than one GPU capped at
    another's amount)."""
    caps_of = {
        (p.entry.request_bytes // MIB, p.entry.limit_mib): p.entry
        for p in planned
        if p.cdi_edits is not None and p.entry.mode == Mode.TIME_SLICING.value
    }
    if len(caps_of) <= 1:
        return
    shown = ", ".join(
        f"{d.device} (request {d.request}: {req}Mi, limit {lim}Mi)"
        for (req, lim), d in caps_of.items()
    )
    raise ClaimError(
        f"{_where(claim)}: time-slicing devices with different amounts in one claim: "
        f"{shown}; a container gets one NVIDIA_GPU_MEMORY_REQUEST/LIMIT pair for all of them "
        "(CDI keeps the last value), so ask the same amount on each GPU or use one claim per "
        "amount"
    )


def claim_spec(planned: Sequence[Planned]) -> dict[str, Any] | None:
    """One spec for the claim: one device per result that needs edits of ours, named as its
    CDI ID says; None when every result is a whole GPU (the driver's devices suffice). Its
    devices were checked per shape, and their names are unique (the result's index)."""
    devices = []
    versions = []
    for p in planned:
        if p.cdi_edits is None:  # the driver's device alone (whole GPU)
            continue
        name = p.entry.cdi_device_ids[-1].split("=", 1)[1]
        devices.append({"name": name, "containerEdits": p.cdi_edits})
        versions.append(p.cdi_version)
    if not devices:
        return None
    version = max(versions, key=cdi_specs.version_tuple)
    return {"cdiVersion": version, "kind": cdi_specs.CLAIM_KIND, "devices": devices}
