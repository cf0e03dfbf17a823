"""EventWatch: the health monitor's NVML event thread, its event set and what each event means.

One event set (Xid, double-bit ECC, GPU unavailable, recovery action) over every GPU not left
out as lost; the thread waits on it, turns each event into a fault on the FaultBook
(faults.py), and builds the set again after a wait error or a lost GPU, with MONITOR
faults on every GPU while it cannot (fail closed). The probe thread (HealthMonitor,
monitor.py) reports the GPUs it finds lost or answering again (`lost`, `returned`); `answers`
and `read_action` are the NVML reads both threads make.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pynvml

from deviceplugin.config.settings import Config
from deviceplugin.health.faults import SEVERITY, FaultBook, class_field
from deviceplugin.health.xid import (
    DOUBLE_BIT_ECC_CLASS,
    XidClass,
    XidPolicy,
    recovery_action_class,
    recovery_action_name,
)
from deviceplugin.inventory.nvml import NvmlError, NvmlSession
from deviceplugin.model import GpuUuid
from deviceplugin.plan import SlicePlan
from deviceplugin.plumbing import logs

_log = logs.get("health")

EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError
EVENT_DOUBLE_BIT_ECC = 0x2  # nvmlEventTypeDoubleBitEccError
EVENT_GPU_UNAVAILABLE = 0x4000  # nvmlEventTypeGpuUnavailableError
EVENT_RECOVERY_ACTION = 0x8000  # nvmlEventTypeGpuRecoveryAction
WANTED_EVENTS = EVENT_XID | EVENT_DOUBLE_BIT_ECC | EVENT_GPU_UNAVAILABLE | EVENT_RECOVERY_ACTION

# Unexplained wait errors (no GPU fails its probe) tolerated before failing closed.
WAIT_ERRORS_BEFORE_FAIL_CLOSED = 3


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """0 for the first retry (other GPUs need their events back), then base, 2×base … cap."""
    if failures <= 1:
        return 0.0
    return float(min(cap, base * 2 ** (failures - 2)))


class EventWatch:
    """The event thread and the event set it waits on; `run` is the thread's body.

    Shares the monitor's lock, FaultBook and halt event. The event set is touched only by
    the event thread once the monitor has started; the GPUs left out of it (`_exclude`) and
    those to register again (`_readd`) are changed under the lock by both threads.
    """

    def __init__(
        self,
        session: NvmlSession,
        plan_source: Callable[[], SlicePlan],
        config_source: Callable[[], Config],
        faults: FaultBook,
        lock: threading.RLock,
        halt: threading.Event,
        *,
        wait_timeout: float,
        backoff_base: float,
        backoff_max: float,
    ) -> None:
        self.session = session
        self.plan_source = plan_source
        self.config_source = config_source
        self.wait_ms = max(1, min(1000, int(wait_timeout * 1000)))  # at most 1 s (DESIGN)
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self._faults = faults
        self._lock = lock
        self._halt = halt
        # Event set, touched only by the event thread after start().
        self._es: Any = None
        self._registered: set[GpuUuid] = set()
        self._exclude: set[GpuUuid] = set()  # lost GPUs left out of the event set
        self._readd: set[GpuUuid] = set()  # returned GPUs to register again
        self._rebuild = False
        self.events_seen = 0  # events handled; tests wait on these counters
        self.event_sets_opened = 0

    def registered_gpus(self) -> frozenset[GpuUuid]:
        """GPUs whose events the current event set delivers."""
        return frozenset(self._registered)

    # ---- what the probe thread saw --------------------------------------------------------

    def lost(self, uuid: GpuUuid) -> None:
        """`uuid` does not answer: if the set delivers its events, the next set leaves it out."""
        with self._lock:
            if uuid in self._registered:
                self._exclude.add(uuid)
                self._rebuild = True

    def returned(self, uuid: GpuUuid) -> None:
        """`uuid` answers: if it was left out, it rejoins the current set."""
        with self._lock:
            if uuid in self._exclude:
                self._exclude.discard(uuid)
                self._readd.add(uuid)

    # ---- event thread ---------------------------------------------------------------------

    def run(self) -> None:
        build_failures = 0
        wait_failures = 0
        while not self._halt.is_set():
            try:
                if self._take_rebuild() or self._es is None:
                    if not self.open_events():
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

    def open_events(self) -> bool:
        """A fresh event set for every GPU not excluded; False and MONITOR faults on failure."""
        self.close_events()
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

    def close_events(self) -> None:
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
        failing = [u for u in sorted(self._registered) if not answers(self.session, u)]
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
        ok, action = read_action(self.session, uuid)
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

    def _all_gpus(self) -> list[GpuUuid]:
        gpus = dict.fromkeys(self.session.handles())
        try:
            gpus.update(dict.fromkeys(p.uuid for p in self.plan_source().gpus))
        except Exception as exc:  # failing closed must not depend on the plan
            logs.log(_log, "plan unavailable", level=logging.ERROR, error=repr(exc))
        return list(gpus)


# ---- NVML reads (both threads) ---------------------------------------------------------------


def answers(session: NvmlSession, uuid: GpuUuid) -> bool:
    """The GPU answers a dynamic query through its cached handle (never re-resolved)."""
    try:
        pynvml.nvmlDeviceGetMemoryInfo(session.handle(uuid))
    except pynvml.NVMLError as err:
        # It replied, just not with memory info: that is an answer.
        return int(err.value) in (
            pynvml.NVML_ERROR_NOT_SUPPORTED,
            pynvml.NVML_ERROR_NO_PERMISSION,
        )
    return True


def read_action(session: NvmlSession, uuid: GpuUuid) -> tuple[bool, int | None]:
    """(read ok, action); action None where the driver lacks field 230."""
    try:
        return True, session.recovery_action(uuid)
    except NvmlError:
        return False, None


def _err(err: pynvml.NVMLError) -> str:
    """A cause-friendly error name: 'GPU is lost' -> 'gpu-is-lost'."""
    return str(err).lower().replace(" ", "-").rstrip(".")
