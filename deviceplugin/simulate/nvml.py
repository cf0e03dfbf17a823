"""A fake NVML library installed as `pynvml.nvmlLib`, so the real pynvml wrappers run.

`FakeNvml` holds one simulated node's GPUs and the Python-side control API (inject_xid,
set_lost, recover, ...) that drives hardware-faithful faults; the C symbols pynvml calls
live in nvml_library.py. Lost GPUs and recovery actions persist in
`<state-dir>/simulate/faults.json`.
"""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

import pynvml

from deviceplugin.health.xid import XidClass as CatalogClass
from deviceplugin.health.xid import catalog_class
from deviceplugin.model import GpuUuid
from deviceplugin.plumbing import fsutil
from deviceplugin.simulate.nvml_library import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_RECOVERY_ACTION,
    EVENT_XID,
    RECOVERY_GPU_RESET,
    RECOVERY_NODE_REBOOT,
    RECOVERY_NONE,
    GpuState,
    NvmlLibrary,
)
from deviceplugin.simulate.specs import SimSpec


class XidClass(StrEnum):
    """What the hardware does after an Xid (reference nvml-mps-xid.md section 4)."""

    APPLICATION = "application"  # NVML stays healthy; MPS servers on the GPU fault
    RESET = "reset"  # recovery action GPU_RESET
    REBOOT = "reboot"  # recovery action NODE_REBOOT
    LOST = "lost"  # Xid 79: the GPU falls off the bus
    IGNORE = "ignore"  # informational only


_EFFECT = {
    CatalogClass.APPLICATION: XidClass.APPLICATION,
    CatalogClass.IGNORED: XidClass.IGNORE,
    CatalogClass.FOLLOW_UP: XidClass.IGNORE,  # 154 only announces a recovery action
    CatalogClass.REBOOT: XidClass.REBOOT,
}


def classify_xid(xid: int) -> XidClass:
    """What the hardware does after `xid`, from NVIDIA's catalog (one copy, in
    deviceplugin.health.xid): 79 loses the GPU; unknown Xids count as reset-class (DESIGN
    section 5)."""
    if xid == 79:
        return XidClass.LOST
    return _EFFECT.get(catalog_class(xid), XidClass.RESET)


class FakeNvml(NvmlLibrary):
    """One simulated node's NVML: the library object plus the control API tests drive."""

    def __init__(
        self,
        spec: SimSpec,
        state_dir: Path | None = None,
        *,
        init_error: int | None = None,
        lost_hides_identity: bool = False,
        on_application_xid: Callable[[GpuUuid], None] | None = None,
    ) -> None:
        self.spec = spec
        self.on_application_xid = on_application_xid
        self._faults_file = state_dir / "simulate" / "faults.json" if state_dir else None
        self._init_error = init_error  # e.g. 9 (DriverNotLoaded) to simulate a node without driver
        self._lost_hides_identity = lost_hides_identity
        self._cond = threading.Condition(threading.RLock())
        self._save_lock = threading.Lock()  # saves in order, outside the event lock
        self._refcount = 0
        self._ever_initialized = False
        self._gpus = []
        for g in spec.gpus:
            anchor = ctypes.create_string_buffer(8)
            self._gpus.append(GpuState(g, anchor, ctypes.addressof(anchor), g.compute_mode))
        self._by_address = {g.address: g for g in self._gpus}
        self._sets = {}
        self._previous: Any = None
        self._installed = False
        self._load_faults()
        self.library = self._build_library()

    # ---- installation -------------------------------------------------------------------

    def install(self) -> None:
        """Swap this fake in as pynvml's library; `uninstall` restores what was there."""
        if self._installed:
            return
        self._previous = pynvml.nvmlLib
        pynvml.nvmlLib = self.library
        pynvml._nvmlGetFunctionPointer_cache.clear()
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed:
            return
        if pynvml.nvmlLib is self.library:
            pynvml.nvmlLib = self._previous
        pynvml._nvmlGetFunctionPointer_cache.clear()
        self._installed = False
        with self._cond:
            self._cond.notify_all()

    # ---- control API (Python side; gpu is an index or a UUID) ----------------------------

    def inject_xid(self, gpu: str | int, xid: int, *, notify: bool = True) -> XidClass:
        """Deliver an Xid event with the hardware's after-effects; returns its class.

        With `notify`, an application Xid calls `on_application_xid` (the MPS fake faults its
        server); the injection listener passes False and relays the fault itself.
        """
        cls = classify_xid(xid)
        with self._cond:
            g = self._gpu(gpu)
            self._queue(g, EVENT_XID, xid)
            if xid == 48:
                self._queue(g, EVENT_DOUBLE_BIT_ECC, 0)
            if cls is XidClass.LOST:
                g.lost = True
                g.recovery_action = RECOVERY_NODE_REBOOT
            elif cls in (XidClass.RESET, XidClass.REBOOT):
                reset = cls is XidClass.RESET
                g.recovery_action = RECOVERY_GPU_RESET if reset else RECOVERY_NODE_REBOOT
                self._queue(g, EVENT_RECOVERY_ACTION, 0)
            self._cond.notify_all()
            uuid = g.spec.uuid
        self._save_faults()
        if cls is XidClass.APPLICATION and notify and self.on_application_xid is not None:
            self.on_application_xid(uuid)
        return cls

    def set_lost(self, gpu: str | int) -> None:
        """The GPU falls off the bus without an event (`simulate inject --lost`)."""
        with self._cond:
            g = self._gpu(gpu)
            g.lost = True
            g.recovery_action = RECOVERY_NODE_REBOOT
            self._cond.notify_all()
        self._save_faults()

    def recover(self, gpu: str | int) -> None:
        """Clear injected faults: the GPU answers again with recovery action NONE."""
        with self._cond:
            g = self._gpu(gpu)
            g.lost = False
            g.recovery_action = RECOVERY_NONE
            self._cond.notify_all()
        self._save_faults()

    def set_recovery_action(self, gpu: str | int, action: int) -> None:
        with self._cond:
            g = self._gpu(gpu)
            g.recovery_action = action
            self._queue(g, EVENT_RECOVERY_ACTION, 0)
            self._cond.notify_all()
        self._save_faults()

    def set_field_error(self, gpu: str | int, field_id: int, ret: int | None) -> None:
        """Make `nvmlDeviceGetFieldValues` report `ret` in that field's own `nvmlReturn` (None:
        answer normally), as a real driver does for a field it cannot read now: the call
        itself still succeeds and the value is left zero."""
        with self._cond:
            errors = self._gpu(gpu).field_errors
            if ret is None:
                errors.pop(field_id, None)
            else:
                errors[field_id] = ret

    def add_process(
        self, gpu: str | int, pid: int, memory: int, *, mps_client: bool = False
    ) -> None:
        """A compute process (or, with `mps_client`, an MPS client) using `memory` bytes."""
        with self._cond:
            g = self._gpu(gpu)
            (g.mps_clients if mps_client else g.processes)[pid] = memory

    def remove_process(self, gpu: str | int, pid: int) -> None:
        with self._cond:
            g = self._gpu(gpu)
            g.processes.pop(pid, None)
            g.mps_clients.pop(pid, None)

    def compute_mode(self, gpu: str | int) -> int:
        with self._cond:
            return self._gpu(gpu).compute_mode

    def is_lost(self, gpu: str | int) -> bool:
        with self._cond:
            return self._gpu(gpu).lost

    def recovery_action(self, gpu: str | int) -> int:
        with self._cond:
            return self._gpu(gpu).recovery_action

    def memory_limits(self, gpu: str | int) -> dict[str, tuple[int, int]]:
        """Cgroup path -> (soft, hard) bytes set through nvmlDeviceSetMemoryLimits_v1."""
        with self._cond:
            return dict(self._gpu(gpu).limits)

    def resolve(self, gpu: str | int) -> GpuUuid:
        """The UUID of the GPU named by index or UUID; KeyError when there is none."""
        with self._cond:
            return self._gpu(gpu).spec.uuid

    # ---- internals ------------------------------------------------------------------------

    def _gpu(self, ref: str | int) -> GpuState:
        return self._gpus[self.spec.gpu(str(ref)).index]

    def _queue(self, g: GpuState, event_type: int, data: int) -> None:
        for es in self._sets.values():
            if es.masks.get(g.address, 0) & event_type:
                es.queue.append((g.address, event_type, data))

    def _load_faults(self) -> None:
        if self._faults_file is None or not self._faults_file.exists():
            return
        try:
            saved = json.loads(self._faults_file.read_text()).get("gpus", {})
        except (OSError, ValueError):
            return  # a damaged file means no saved faults, not a crash
        for g in self._gpus:
            entry = saved.get(g.spec.uuid, {})
            g.lost = bool(entry.get("lost", False))
            g.recovery_action = int(entry.get("recoveryAction", RECOVERY_NONE))

    def _save_faults(self) -> None:
        """Persist lost GPUs and recovery actions (a restarted plugin finds them), after the
        event is delivered and outside the event lock: hardware raises an Xid without a disk
        write, and an fsync under the lock held the event thread's wait back by milliseconds
        (tens on a busy disk) in the Xid to ListAndWatch figure. Saves run one at a time, each
        writing the state as it is when it runs, so the last one written is the newest."""
        if self._faults_file is None:
            return
        with self._save_lock:
            with self._cond:
                gpus = {
                    g.spec.uuid: {"lost": g.lost, "recoveryAction": g.recovery_action}
                    for g in self._gpus
                    if g.lost or g.recovery_action != RECOVERY_NONE
                }
            self._faults_file.parent.mkdir(parents=True, exist_ok=True)
            data = json.dumps({"version": 1, "gpus": gpus}, indent=2, sort_keys=True)
            fsutil.atomic_write(self._faults_file, data.encode())
