"""FaultBook: the health monitor's per-GPU fault records and the board updates they make.

Which faults each GPU holds (GPU with its recovery phase, MPS server after an application
Xid, MONITOR while monitoring cannot run), which cause wins, when a fault clears, and the
`Transition`s that report each change. Bookkeeping over the HealthBoard, under the monitor's
lock: no NVML and no threads of its own, so the monitor's threads (monitor.py,
events.py) only say what they saw.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from deviceplugin.health.board import HealthBoard, device_health
from deviceplugin.health.xid import RECOVERY_NONE, XidClass
from deviceplugin.model import FaultDomain, GpuUuid, Mode
from deviceplugin.plan import GpuPlan, SlicePlan
from deviceplugin.plumbing import logs

_log = logs.get("health")

MpsServerActive = Callable[[GpuUuid, float], bool | None]
"""(gpu, since): True when the GPU's MPS server is ACTIVE at a probe started at or after
`since` (the monitor's clock); None when unknown (no daemon yet, no probe since)."""


@dataclass(frozen=True)
class Transition:
    """One domain of one GPU changed: `healthy` False = fault set (or its cause changed)."""

    gpu: GpuUuid
    domain: FaultDomain
    cause: str
    healthy: bool
    at: float  # wall-clock seconds
    mode: Mode | None = None
    slices: int = 0  # devices of the GPU this domain takes down


class Phase(StrEnum):
    FAULTED = "faulted"  # waiting for the GPU to answer with recovery action NONE
    QUIET = "quiet"  # recovered; Healthy once the quiet period passes without a new fault


# The classes that fault a whole GPU, by precedence (gpu_fault: which cause the GPU keeps).
SEVERITY = {XidClass.RESET: 1, XidClass.REBOOT: 2}


@dataclass
class _GpuFault:
    cause: str
    cls: XidClass
    phase: Phase
    quiet_since: float | None = None  # monotonic
    operator_cleared: bool = False


@dataclass
class _AppFault:
    cause: str
    at: float  # monotonic; the server's state is trusted only from probes after this


class FaultBook:
    """The monitor's fault records, changed under the monitor's lock (shared, reentrant).

    Every change that moves the board is logged as a `Transition` and handed to
    `on_transition`; `dirty` is set whenever `health.json` would read differently. Board
    updates happen under the lock, so board listeners must not block. `mps_server_active` is
    asked whether an sm-sharing GPU's MPS server is ACTIVE again after an application Xid; it
    is trusted only `mps_settle` seconds after the Xid.
    """

    def __init__(
        self,
        board: HealthBoard,
        plan_source: Callable[[], SlicePlan],
        lock: threading.RLock,
        dirty: threading.Event,
        *,
        clock: Callable[[], float],
        wall: Callable[[], float],
        on_transition: Callable[[Transition], None] | None,
        mps_server_active: MpsServerActive | None,
        mps_settle: float,
    ) -> None:
        self.board = board
        self.plan_source = plan_source
        self.clock = clock
        self.wall = wall
        self.on_transition = on_transition
        self.mps_server_active = mps_server_active
        self.mps_settle = mps_settle
        self._lock = lock
        self._dirty = dirty
        self._gpu_faults: dict[GpuUuid, _GpuFault] = {}
        # recovery action an operator's clear accepted while NVML still reported it (stale)
        self._acknowledged: dict[GpuUuid, int] = {}
        self._app_faults: dict[GpuUuid, _AppFault] = {}
        self._monitor_faulted: set[GpuUuid] = set()

    def gpu_fault(self, uuid: GpuUuid, cause: str, cls: XidClass) -> None:
        """Every slice of the GPU; a fault during the quiet period starts recovery over."""
        transitions: list[Transition] = []
        with self._lock:
            fault = self._gpu_faults.get(uuid)
            if fault is None:
                self._gpu_faults[uuid] = _GpuFault(cause, cls, Phase.FAULTED)
                transitions += self._set(uuid, FaultDomain.GPU, cause)
            else:
                if fault.phase is Phase.QUIET:
                    logs.log(_log, "quiet period restarted", gpu=uuid, cause=cause)
                    self._dirty.set()
                fault.phase, fault.quiet_since, fault.operator_cleared = Phase.FAULTED, None, False
                severity, held = SEVERITY.get(cls, 1), SEVERITY.get(fault.cls, 1)
                # An escalation (reset -> lost), or the Xid behind a loss the probe or the
                # event wait saw first (the same fault, now with its cause: `xid-79`, not
                # `gpu-lost`, whichever thread won the race).
                refined = severity == held and _generic_loss(fault.cause) and _is_xid(cause)
                if severity > held or refined:
                    fault.cause, fault.cls = cause, cls
                    transitions += self._set(uuid, FaultDomain.GPU, cause)
        self._emit(transitions)

    def application_fault(self, uuid: GpuUuid, cause: str) -> None:
        """sm-sharing: the GPU's MPS server is faulted; other modes: nothing changes."""
        gp = self.plan_source().for_gpu(uuid)
        if gp is None or gp.mode is not Mode.SM_SHARING:
            mode = gp.mode if gp is not None else "unplanned"
            logs.log(_log, "application xid, no health change", gpu=uuid, mode=mode, cause=cause)
            return
        transitions: list[Transition] = []
        with self._lock:
            current = self._app_faults.get(uuid)
            # A repeat keeps the first cause (no board churn in a storm) but restarts the settle.
            cause = current.cause if current is not None else cause
            self._app_faults[uuid] = _AppFault(cause, self.clock())
            transitions += self._set(uuid, FaultDomain.MPS_SERVER, cause)
        self._emit(transitions)

    def monitor_fault(self, gpus: Iterable[GpuUuid], cause: str) -> None:
        transitions: list[Transition] = []
        with self._lock:
            for uuid in gpus:
                self._monitor_faulted.add(uuid)
                transitions += self._set(uuid, FaultDomain.MONITOR, cause)
        self._emit(transitions)

    def monitor_ok(self) -> None:
        """A wait returned normally: monitoring runs, so MONITOR faults clear."""
        if not self._monitor_faulted:
            return
        transitions: list[Transition] = []
        with self._lock:
            for uuid in sorted(self._monitor_faulted):
                current = self.board.faults(uuid).get(FaultDomain.MONITOR)
                transitions += self._clear(
                    uuid, FaultDomain.MONITOR, current.cause if current else ""
                )
            self._monitor_faulted.clear()
        self._emit(transitions)

    def maybe_recover(self, uuid: GpuUuid, action: int | None, quiet: float) -> None:
        now = self.clock()
        transitions: list[Transition] = []
        with self._lock:
            fault = self._gpu_faults.get(uuid)
            if fault is None:
                return
            if fault.phase is Phase.FAULTED:
                if action is None and not fault.operator_cleared:
                    return  # NVML cannot say it recovered: waits for `health clear`
                fault.phase, fault.quiet_since = Phase.QUIET, now
                self._dirty.set()
                logs.log(_log, "gpu recovering", gpu=uuid, cause=fault.cause, quiet_period=quiet)
            if fault.quiet_since is not None and now - fault.quiet_since >= quiet:
                del self._gpu_faults[uuid]
                transitions += self._clear(uuid, FaultDomain.GPU, fault.cause)
        self._emit(transitions)

    def check_app_faults(self) -> None:
        now = self.clock()
        plan = self.plan_source()
        with self._lock:
            pending = dict(self._app_faults)
        for uuid, fault in pending.items():
            gp = plan.for_gpu(uuid)
            sm = gp is not None and gp.mode is Mode.SM_SHARING
            if sm and now - fault.at < self.mps_settle:
                continue
            active = (
                self.mps_server_active(uuid, fault.at) if sm and self.mps_server_active else None
            )
            if sm and active is not True:
                continue
            transitions: list[Transition] = []
            with self._lock:
                if self._app_faults.get(uuid) is not fault:
                    continue  # a newer Xid arrived meanwhile
                del self._app_faults[uuid]
                current = self.board.faults(uuid).get(FaultDomain.MPS_SERVER)
                # Only our own cause: the supervisor's (server FAULT, UID conflict) is its own.
                if current is not None and current.cause == fault.cause:
                    transitions += self._clear(uuid, FaultDomain.MPS_SERVER, fault.cause)
            self._emit(transitions)

    def operator_clear(self, uuid: GpuUuid, action: int | None) -> bool:
        """`health clear`: False when the GPU holds no GPU fault. `action` is the recovery action
        NVML reports now (None: unread); an operator's clear accepts it until it changes."""
        with self._lock:
            fault = self._gpu_faults.get(uuid)
            if fault is not None:
                fault.operator_cleared = True
                if action is not None and action != RECOVERY_NONE:
                    # NVML still says it; the operator says it is done: believe the
                    # operator for this value until NVML reports another.
                    self._acknowledged[uuid] = action
        return fault is not None

    def unacknowledged(self, uuid: GpuUuid, action: int | None) -> int | None:
        """`action`, or None while it is the value an operator's clear accepted (a changed
        value forgets that acceptance)."""
        with self._lock:
            acknowledged = self._acknowledged.get(uuid)
            if acknowledged is None:
                return action
            if action == acknowledged:
                return None
            del self._acknowledged[uuid]
        return action

    def has_gpu_fault(self, uuid: GpuUuid) -> bool:
        return uuid in self._gpu_faults

    def phases(self) -> dict[GpuUuid, tuple[Phase, float | None]]:
        """Each GPU fault's recovery phase and, in QUIET, since when (monotonic)."""
        with self._lock:
            return {u: (f.phase, f.quiet_since) for u, f in self._gpu_faults.items()}

    def _set(self, uuid: GpuUuid, domain: FaultDomain, cause: str) -> list[Transition]:
        if not self.board.set(uuid, domain, cause):
            return []
        return [self._transition(uuid, domain, cause, healthy=False)]

    def _clear(self, uuid: GpuUuid, domain: FaultDomain, cause: str) -> list[Transition]:
        if not self.board.clear(uuid, domain):
            return []
        return [self._transition(uuid, domain, cause, healthy=True)]

    def _transition(
        self, uuid: GpuUuid, domain: FaultDomain, cause: str, healthy: bool
    ) -> Transition:
        gp = self.plan_source().for_gpu(uuid)
        mode = gp.mode if gp is not None else None
        return Transition(uuid, domain, cause, healthy, self.wall(), mode, _slices(gp, domain))

    def _emit(self, transitions: list[Transition]) -> None:
        for t in transitions:
            faults = self.board.faults(t.gpu)
            health = device_health(t.mode, faults, allocated=False) if t.mode else "-"
            cls = next((p.split("=", 1)[1] for p in t.cause.split() if p.startswith("class=")), "-")
            logs.log(
                _log,
                "health transition",
                level=logging.INFO if t.healthy else logging.WARNING,
                gpu=t.gpu,
                mode=t.mode or "-",
                domain=t.domain,
                cause=t.cause,
                **class_field(cls),
                slices=t.slices,
                health=health,
                cleared=t.healthy,
            )
            self._dirty.set()
            if self.on_transition is not None:
                try:
                    self.on_transition(t)
                except Exception as exc:  # a consumer's bug must not stop health updates
                    logs.log(_log, "transition hook failed", level=logging.ERROR, error=repr(exc))


def _generic_loss(cause: str) -> bool:
    return cause.startswith("gpu-lost")


def _is_xid(cause: str) -> bool:
    return cause.startswith("xid=")


def _slices(gp: GpuPlan | None, domain: FaultDomain) -> int:
    if gp is None:
        return 0
    if (
        domain in (FaultDomain.MPS_SERVER, FaultDomain.MPS_DAEMON)
        and gp.mode is not Mode.SM_SHARING
    ):
        return 0
    return len(gp.device_ids)


def class_field(cls: object) -> dict[str, Any]:
    # `class` is a keyword, so the log field travels in a dict.
    return {"class": str(cls)}
