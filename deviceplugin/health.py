"""HealthMonitor: NVML events and periodic probes turned into fault domains on the HealthBoard.

An event thread waits on one NVML event set (Xid, double-bit ECC, GPU unavailable, recovery
action); a probe thread notices lost and returned GPUs, reads the recovery action, consumes
operator clears and ends quiet periods. Faults map to domains per DESIGN section 5 and clear
again; if monitoring cannot run, every GPU carries a MONITOR fault (fail closed). The fault
records and their transitions are a FaultBook (healthfaults.py); this module does the I/O.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml

from deviceplugin import healthstate, logs
from deviceplugin.config import Config
from deviceplugin.healthboard import HealthBoard, device_health
from deviceplugin.healthfaults import (
    SEVERITY,
    FaultBook,
    MpsServerActive,
    Transition,
    class_field,
)
from deviceplugin.model import FaultDomain, GpuUuid
from deviceplugin.mps.supervisor import MpsSupervisor
from deviceplugin.nvml import NvmlError, NvmlSession
from deviceplugin.plan import SlicePlan
from deviceplugin.xid import (
    DOUBLE_BIT_ECC_CLASS,
    RECOVERY_NONE,
    XidClass,
    XidPolicy,
    recovery_action_class,
    recovery_action_name,
)

_log = logs.get("health")

EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError
EVENT_DOUBLE_BIT_ECC = 0x2  # nvmlEventTypeDoubleBitEccError
EVENT_GPU_UNAVAILABLE = 0x4000  # nvmlEventTypeGpuUnavailableError
EVENT_RECOVERY_ACTION = 0x8000  # nvmlEventTypeGpuRecoveryAction
WANTED_EVENTS = EVENT_XID | EVENT_DOUBLE_BIT_ECC | EVENT_GPU_UNAVAILABLE | EVENT_RECOVERY_ACTION

# Unexplained wait errors (no GPU fails its probe) tolerated before failing closed.
WAIT_ERRORS_BEFORE_FAIL_CLOSED = 3


def supervisor_server_active(supervisor: MpsSupervisor) -> MpsServerActive:
    """The supervisor's last probe: True only on a positive ACTIVE for every server its
    daemon lists (DESIGN 3b), at a probe taken after the Xid; a daemon that is not READY,
    a probe from before, or an answer the parser does not know keeps the fault."""
    return supervisor.server_active


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """0 for the first retry (other GPUs need their events back), then base, 2×base … cap."""
    if failures <= 1:
        return 0.0
    return float(min(cap, base * 2 ** (failures - 2)))


class HealthMonitor:
    """Owns the event and probe threads; `start()`/`stop()` are idempotent.

    Board updates happen under the monitor's lock, so board listeners must not block.
    `mps_server_active` is asked whether an sm-sharing GPU's MPS server is ACTIVE again after
    an application Xid; it is trusted only `mps_settle` seconds after the Xid, so a probe
    taken before the fault cannot clear it.
    """

    def __init__(
        self,
        session: NvmlSession,
        plan_source: Callable[[], SlicePlan],
        config_source: Callable[[], Config],
        board: HealthBoard,
        state_dir: Path,
        *,
        mps_server_active: MpsServerActive | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        probe_interval: float = 1.0,
        on_transition: Callable[[Transition], None] | None = None,
        wait_timeout: float = 1.0,
        mps_settle: float = 2.0,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
    ) -> None:
        self.session = session
        self.plan_source = plan_source
        self.config_source = config_source
        self.board = board
        self.state_dir = state_dir
        self.clock = clock
        self.wall = wall
        self.probe_interval = probe_interval
        self.wait_ms = max(1, min(1000, int(wait_timeout * 1000)))  # at most 1 s (DESIGN)
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max

        self._lock = threading.RLock()
        self._tick_lock = threading.Lock()
        self._halt = threading.Event()
        self._dirty = threading.Event()
        self._threads: list[threading.Thread] = []
        self._unsubscribe: Callable[[], None] | None = None
        self._started = False

        self._faults = FaultBook(
            board,
            plan_source,
            self._lock,
            self._dirty,
            clock=clock,
            wall=wall,
            on_transition=on_transition,
            mps_server_active=mps_server_active,
            mps_settle=mps_settle,
        )
        # Event set, touched only by the event thread after start().
        self._es: Any = None
        self._registered: set[GpuUuid] = set()
        self._exclude: set[GpuUuid] = set()  # lost GPUs left out of the event set
        self._readd: set[GpuUuid] = set()  # returned GPUs to register again
        self._rebuild = False
        self.events_seen = 0  # events handled; tests wait on these counters
        self.event_sets_opened = 0

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Build the event set now (MONITOR faults if it fails), then start the threads."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._halt.clear()
        self._unsubscribe = self.board.subscribe(self._dirty.set)
        self._mark_lost_at_start()
        self._open_events()
        self.tick()  # lost GPUs and pending recovery actions count before anyone reads health
        self._write_state()
        for name, target in (
            ("health-events", self._event_loop),
            ("health-probe", self._probe_loop),
            ("health-state", self._state_loop),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        logs.log(_log, "health monitor started", gpus=len(self.session.handles()))

    def stop(self) -> None:
        with self._lock:
            if not self._started:
                return
            self._started = False
        self._halt.set()
        self._dirty.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        self._threads.clear()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._close_events()
        self._write_state(running=False)
        logs.log(_log, "health monitor stopped")

    def registered_gpus(self) -> frozenset[GpuUuid]:
        """GPUs whose events the current event set delivers."""
        return frozenset(self._registered)

    @property
    def running(self) -> bool:
        return all(t.is_alive() for t in self._threads) and bool(self._threads)

    # ---- event thread ---------------------------------------------------------------------

    def _event_loop(self) -> None:
        build_failures = 0
        wait_failures = 0
        while not self._halt.is_set():
            try:
                if self._take_rebuild() or self._es is None:
                    if not self._open_events():
                        build_failures += 1
                        self._halt.wait(self._backoff(build_failures + 1))
                        continue
                    build_failures = 0
                self._register_returned()
                try:
                    data = pynvml.nvmlEventSetWait_v2(self._es, self.wait_ms)
                except pynvml.NVMLError_Timeout:
                    wait_failures = 0
                    self._faults.monitor_ok()
                    continue
                except pynvml.NVMLError as err:
                    wait_failures += 1
                    self._wait_failed(err, wait_failures)
                    self._halt.wait(self._backoff(wait_failures))
                    continue
                wait_failures = 0
                self._faults.monitor_ok()
                self._on_event(data)
                self.events_seen += 1  # after handling: tests wait on it
            except Exception as exc:  # keep monitoring whatever happens, but fail closed
                logs.log(_log, "health event loop error", level=logging.ERROR, error=repr(exc))
                self._faults.monitor_fault(self._all_gpus(), f"monitor-error {type(exc).__name__}")
                build_failures += 1
                with self._lock:
                    self._rebuild = True
                self._halt.wait(self._backoff(build_failures + 1))

    def _backoff(self, failures: int) -> float:
        return backoff_delay(failures, self.backoff_base, self.backoff_max)

    def _take_rebuild(self) -> bool:
        with self._lock:
            wanted, self._rebuild = self._rebuild, False
        return wanted

    def _open_events(self) -> bool:
        """A fresh event set for every GPU not excluded; False and MONITOR faults on failure."""
        self._close_events()
        try:
            es = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as err:
            logs.log(_log, "event set create failed", level=logging.ERROR, error=str(err))
            self._faults.monitor_fault(
                self._all_gpus(), f"monitor-failed event-set error={_err(err)}"
            )
            return False
        with self._lock:
            exclude = set(self._exclude)
            self._readd.clear()
        registered: set[GpuUuid] = set()
        for uuid, handle in self.session.handles().items():
            if uuid in exclude:
                continue
            try:
                if self._register(uuid, handle, es):
                    registered.add(uuid)
            except pynvml.NVMLError as err:
                logs.log(
                    _log, "event register failed", level=logging.ERROR, gpu=uuid, error=str(err)
                )
                self._free(es)
                self._faults.monitor_fault(
                    self._all_gpus(), f"monitor-failed register error={_err(err)}"
                )
                return False
        self._es = es
        self._registered = registered
        self.event_sets_opened += 1
        return True

    def _register(self, uuid: GpuUuid, handle: Any, es: Any) -> bool:
        """Register the wanted events the GPU supports; False when it has none or is lost."""
        try:
            supported = int(pynvml.nvmlDeviceGetSupportedEventTypes(handle))
            mask = WANTED_EVENTS & supported
            if not mask:
                logs.log(_log, "gpu has no health events", level=logging.WARNING, gpu=uuid)
                return False
            pynvml.nvmlDeviceRegisterEvents(handle, mask, es)
        except pynvml.NVMLError_NotSupported:
            # Older drivers: no events, the probe thread still notices a lost GPU.
            logs.log(_log, "health events not supported", level=logging.WARNING, gpu=uuid)
            return False
        except pynvml.NVMLError_GpuIsLost:
            self._faults.gpu_fault(uuid, "gpu-lost at-register", XidClass.REBOOT)
            with self._lock:
                self._exclude.add(uuid)
            return False
        if not mask & EVENT_XID:
            logs.log(_log, "gpu has no xid events", level=logging.WARNING, gpu=uuid)
        return True

    def _register_returned(self) -> None:
        """GPUs that answer again rejoin the current set (no rebuild: events are not lost)."""
        with self._lock:
            returned, self._readd = self._readd, set()
        for uuid in sorted(returned):
            try:
                if self._register(uuid, self.session.handle(uuid), self._es):
                    self._registered.add(uuid)
                    logs.log(_log, "gpu events registered again", gpu=uuid)
            except pynvml.NVMLError as err:
                logs.log(_log, "event re-register failed", gpu=uuid, error=str(err))
                with self._lock:
                    self._readd.add(uuid)

    def _close_events(self) -> None:
        es, self._es = self._es, None
        self._registered = set()
        if es is not None:
            self._free(es)

    @staticmethod
    def _free(es: Any) -> None:
        try:
            pynvml.nvmlEventSetFree(es)
        except pynvml.NVMLError as err:
            logs.log(_log, "event set free failed", error=str(err))

    def _wait_failed(self, err: pynvml.NVMLError, failures: int) -> None:
        """Probe every registered GPU through its cached handle: only failing ones are faulted."""
        failing = [u for u in sorted(self._registered) if not self._answers(u)]
        logs.log(
            _log,
            "event wait failed",
            level=logging.WARNING,
            error=str(err),
            failing=",".join(failing) or "none",
        )
        for uuid in failing:
            self._faults.gpu_fault(uuid, f"gpu-lost error={_err(err)}", XidClass.REBOOT)
        with self._lock:
            self._exclude.update(failing)
            self._rebuild = True
        if not failing and failures >= WAIT_ERRORS_BEFORE_FAIL_CLOSED:
            self._faults.monitor_fault(
                self._all_gpus(), f"monitor-failed event-wait error={_err(err)}"
            )

    def _on_event(self, data: Any) -> None:
        uuid = self.session.uuid_for_handle(data.device)
        etype, edata = int(data.eventType), int(data.eventData)
        policy = XidPolicy.from_config(self.config_source().health)
        if etype & EVENT_XID:
            cls, cause = policy.classify(edata), f"xid={edata}"
        elif etype & EVENT_DOUBLE_BIT_ECC:
            cls, cause = DOUBLE_BIT_ECC_CLASS, "double-bit-ecc"
        elif etype & EVENT_GPU_UNAVAILABLE:
            cls, cause = XidClass.REBOOT, "gpu-unavailable"
        elif etype & EVENT_RECOVERY_ACTION:
            cls, cause = XidClass.FOLLOW_UP, "recovery-action-event"
        else:
            logs.log(_log, "event ignored", gpu=uuid or "unknown", type=hex(etype))
            return
        if uuid is None:
            self._unknown_device(cause, cls)
            return
        self._classified(uuid, cause, cls)

    def _classified(self, uuid: GpuUuid, cause: str, cls: XidClass) -> None:
        if cls is XidClass.FOLLOW_UP:
            self._follow_up(uuid, cause)
        elif cls is XidClass.APPLICATION:
            self._faults.application_fault(uuid, f"{cause} class={cls}")
        elif cls is XidClass.IGNORED:
            logs.log(_log, "xid ignored", gpu=uuid, cause=cause, **class_field(cls))
        else:
            self._faults.gpu_fault(uuid, f"{cause} class={cls}", cls)

    def _unknown_device(self, cause: str, cls: XidClass) -> None:
        if cls is XidClass.IGNORED:
            logs.log(_log, "xid ignored", gpu="unknown", cause=cause, **class_field(cls))
            return
        # Unattributable: every GPU is suspect; each recovers on its own once it answers.
        logs.log(_log, "event for unknown device", level=logging.WARNING, cause=cause)
        for uuid in self._all_gpus():
            if cls is XidClass.FOLLOW_UP:
                self._follow_up(uuid, f"unknown-device {cause}")
            else:
                gpu_cls = cls if cls in SEVERITY else XidClass.RESET
                self._faults.gpu_fault(uuid, f"unknown-device {cause} class={cls}", gpu_cls)

    def _follow_up(self, uuid: GpuUuid, cause: str) -> None:
        """Xid 154 or a recovery-action event: the recovery action field says what to do."""
        ok, action = self._read_action(uuid)
        if not ok:
            return  # the GPU does not answer: the probe thread faults it
        action = self._faults.unacknowledged(uuid, action)
        if action is None:
            logs.log(_log, "recovery action unsupported", level=logging.WARNING, gpu=uuid)
            return
        cls = recovery_action_class(action)
        if cls is None:
            logs.log(_log, "recovery action none", gpu=uuid, cause=cause)
            return
        self._faults.gpu_fault(
            uuid, f"{cause} recovery-action={recovery_action_name(action)} class={cls}", cls
        )

    # ---- probe thread ---------------------------------------------------------------------

    def _probe_loop(self) -> None:
        while not self._halt.wait(self.probe_interval):
            try:
                self.tick()
            except Exception as exc:  # a failed probe round must not end the probing
                logs.log(_log, "health probe error", level=logging.ERROR, error=repr(exc))

    def tick(self) -> None:
        """One probe round: operator clears, lost/returned GPUs, recovery, MPS faults."""
        with self._tick_lock:
            self._consume_clears()
            quiet = self.config_source().health.quiet_period
            for uuid in self.session.handles():
                self._probe_gpu(uuid, quiet)
            self._faults.check_app_faults()

    def _consume_clears(self) -> None:
        try:
            requests = healthstate.take_clears(self.state_dir)
        except OSError as err:
            logs.log(_log, "clear requests unreadable", level=logging.WARNING, error=str(err))
            return
        for uuid in requests:
            # A failed read is (False, None): no action for the clear to accept.
            action = self._read_action(uuid)[1] if self._faults.has_gpu_fault(uuid) else None
            accepted = self._faults.operator_clear(uuid, action)
            logs.log(
                _log,
                "operator clear",
                gpu=uuid,
                result="accepted" if accepted else "no-gpu-fault",
            )

    def _probe_gpu(self, uuid: GpuUuid, quiet: float) -> None:
        if not self._answers(uuid):
            self._faults.gpu_fault(uuid, "gpu-lost", XidClass.REBOOT)
            with self._lock:
                if uuid in self._registered:
                    self._exclude.add(uuid)
                    self._rebuild = True
            return
        with self._lock:
            if uuid in self._exclude:
                self._exclude.discard(uuid)
                self._readd.add(uuid)
        ok, action = self._read_action(uuid)
        # The GPU answered above, so a failed read is no value, never a reason to stop here:
        # an operator's clear must still apply.
        action = self._faults.unacknowledged(uuid, action) if ok else None
        if action is not None and action != RECOVERY_NONE:
            cls = recovery_action_class(action) or XidClass.RESET
            self._faults.gpu_fault(
                uuid, f"recovery-action={recovery_action_name(action)} class={cls}", cls
            )
            return
        self._faults.maybe_recover(uuid, action, quiet)

    def _mark_lost_at_start(self) -> None:
        # GPUs lost before their UUID could be read have no handle to probe: faulted for good.
        for gp in self.plan_source().gpus:
            if gp.gpu.lost and gp.uuid not in self.session.handles():
                self._faults.gpu_fault(gp.uuid, "gpu-lost at-start", XidClass.REBOOT)

    # ---- NVML reads -----------------------------------------------------------------------

    def _answers(self, uuid: GpuUuid) -> bool:
        """The GPU answers a dynamic query through its cached handle (never re-resolved)."""
        try:
            pynvml.nvmlDeviceGetMemoryInfo(self.session.handle(uuid))
        except pynvml.NVMLError as err:
            # It replied, just not with memory info: that is an answer.
            return int(err.value) in (
                pynvml.NVML_ERROR_NOT_SUPPORTED,
                pynvml.NVML_ERROR_NO_PERMISSION,
            )
        return True

    def _read_action(self, uuid: GpuUuid) -> tuple[bool, int | None]:
        """(read ok, action); action None where the driver lacks field 230."""
        try:
            return True, self.session.recovery_action(uuid)
        except NvmlError:
            return False, None

    def _all_gpus(self) -> list[GpuUuid]:
        gpus = dict.fromkeys(self.session.handles())
        try:
            gpus.update(dict.fromkeys(p.uuid for p in self.plan_source().gpus))
        except Exception as exc:  # failing closed must not depend on the plan
            logs.log(_log, "plan unavailable", level=logging.ERROR, error=repr(exc))
        return list(gpus)

    # ---- state file -----------------------------------------------------------------------

    def _state_loop(self) -> None:
        while not self._halt.is_set():
            self._dirty.wait()
            if self._halt.is_set():
                return
            self._dirty.clear()
            self._write_state()

    def state(self, running: bool = True) -> dict[str, Any]:
        """What `health.json` holds: per GPU its mode, health and faults with cause and since."""
        now, wall = self.clock(), self.wall()
        quiet = self.config_source().health.quiet_period
        plan = self.plan_source()
        snapshot = self.board.snapshot()
        phases = self._faults.phases()
        gpus: dict[str, Any] = {}
        uuids = dict.fromkeys([*(p.uuid for p in plan.gpus), *snapshot])
        for uuid in uuids:
            gp = plan.for_gpu(uuid)
            faults = snapshot.get(uuid, {})
            entries: dict[str, Any] = {}
            for domain, fault in faults.items():
                entry: dict[str, Any] = {"cause": fault.cause, "since": fault.since}
                if domain is FaultDomain.GPU and uuid in phases:
                    phase, since = phases[uuid]
                    entry["phase"] = phase.value
                    if since is not None:
                        entry["quietUntil"] = wall + max(0.0, since + quiet - now)
                entries[domain.value] = entry
            gpus[uuid] = {
                "index": gp.gpu.index if gp is not None else None,
                "mode": gp.mode.value if gp is not None else None,
                "health": device_health(gp.mode, faults, allocated=False).value
                if gp is not None
                else None,
                "faults": entries,
            }
        return {
            "version": healthstate.STATE_VERSION,
            "updatedAt": wall,
            "monitor": {"running": running, "pid": os.getpid()},
            "gpus": gpus,
        }

    def _write_state(self, running: bool = True) -> None:
        try:
            healthstate.write_health(self.state_dir, self.state(running))
        except OSError as err:
            logs.log(_log, "health state write failed", level=logging.WARNING, error=str(err))


def _err(err: pynvml.NVMLError) -> str:
    """A cause-friendly error name: 'GPU is lost' -> 'gpu-is-lost'."""
    return str(err).lower().replace(" ", "-").rstrip(".")
