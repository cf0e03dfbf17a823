"""A fake NVML library installed as `pynvml.nvmlLib`, so the real pynvml wrappers run.

Each exported attribute is a plain function named like the C symbol, returning an int NVML
return code and writing through ctypes out-params (reference nvml-mps-xid.md 2.7). The
Python-side control API (inject_xid, set_lost, recover, ...) drives hardware-faithful faults;
lost GPUs and recovery actions persist in `<state-dir>/simulate/faults.json`.
"""

from __future__ import annotations

import ctypes
import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

from deviceplugin import fsutil
from deviceplugin.model import GpuUuid
from deviceplugin.simulate.specs import RECOVERY_ACTION_BRANCH, SimGpu, SimSpec
from deviceplugin.xid import XidClass as CatalogClass
from deviceplugin.xid import catalog_class

# NVML return codes used here (nvml.h).
SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
TIMEOUT = 10
GPU_IS_LOST = 15
ARGUMENT_VERSION_MISMATCH = 25

EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_PSTATE = 0x4
EVENT_XID = 0x8
EVENT_CLOCK = 0x10
EVENT_RECOVERY_ACTION = 0x8000

FIELD_RECOVERY_ACTION = 230
RECOVERY_NONE = 0
RECOVERY_GPU_RESET = 1
RECOVERY_NODE_REBOOT = 2

NO_INSTANCE = 0xFFFFFFFF  # GI/CI of an event or process that is not on a MIG instance
MEMORY_V2 = 0x02000028  # pynvml.nvmlMemory_v2
MEMORY_LIMIT_MAX = 0xFFFFFFFFFFFFFFFF

_ERROR_STRINGS = {
    19: b"In use by another client",
    21: b"No data",
    25: b"Argument version mismatch",
    27: b"Not ready",
    28: b"GPU not found",
    29: b"Invalid state",
}


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
    """What the hardware does after `xid`, from NVIDIA's catalog (one copy, in deviceplugin.xid):
    79 loses the GPU; unknown Xids count as reset-class (DESIGN section 5)."""
    if xid == 79:
        return XidClass.LOST
    return _EFFECT.get(catalog_class(xid), XidClass.RESET)


class _Ret(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _address(obj: Any) -> int | None:
    """The address a handle or event-set pointer holds; never compare the objects."""
    if obj is None:
        return None
    value: int | None = ctypes.cast(obj, ctypes.c_void_p).value
    return value


def _text(value: bytes | str | None) -> str:
    # pynvml's structures may hand c_char_p fields back as str or bytes.
    return value.decode() if isinstance(value, bytes) else (value or "")


def _write_pointer(target: Any, address: int) -> None:
    ctypes.c_void_p.from_buffer(target).value = address


def _write_string(buf: Any, length: Any, text: str) -> None:
    data = text.encode()
    if len(data) + 1 > int(length.value):
        raise _Ret(INSUFFICIENT_SIZE)
    buf.value = data


@dataclass
class _Gpu:
    spec: SimGpu
    anchor: Any  # a real allocation whose address is the handle, kept alive with the fake
    address: int
    compute_mode: int
    lost: bool = False
    recovery_action: int = RECOVERY_NONE
    processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes
    mps_clients: dict[int, int] = field(default_factory=dict)
    limits: dict[str, tuple[int, int]] = field(default_factory=dict)  # cgroup -> soft, hard
    field_errors: dict[int, int] = field(default_factory=dict)  # field id -> nvmlReturn


@dataclass
class _EventSet:
    anchor: Any
    masks: dict[int, int] = field(default_factory=dict)  # GPU handle address -> event mask
    queue: deque[tuple[int, int, int]] = field(default_factory=deque)  # (gpu, type, data)


class FakeNvml:
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
        self._refcount = 0
        self._ever_initialized = False
        self._gpus: list[_Gpu] = []
        for g in spec.gpus:
            anchor = ctypes.create_string_buffer(8)
            self._gpus.append(_Gpu(g, anchor, ctypes.addressof(anchor), g.compute_mode))
        self._by_address = {g.address: g for g in self._gpus}
        self._sets: dict[int, _EventSet] = {}
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
            self._save_faults()
            self._cond.notify_all()
            uuid = g.spec.uuid
        if cls is XidClass.APPLICATION and notify and self.on_application_xid is not None:
            self.on_application_xid(uuid)
        return cls

    def set_lost(self, gpu: str | int) -> None:
        """The GPU falls off the bus without an event (`simulate inject --lost`)."""
        with self._cond:
            g = self._gpu(gpu)
            g.lost = True
            g.recovery_action = RECOVERY_NODE_REBOOT
            self._save_faults()
            self._cond.notify_all()

    def recover(self, gpu: str | int) -> None:
        """Clear injected faults: the GPU answers again with recovery action NONE."""
        with self._cond:
            g = self._gpu(gpu)
            g.lost = False
            g.recovery_action = RECOVERY_NONE
            self._save_faults()
            self._cond.notify_all()

    def set_recovery_action(self, gpu: str | int, action: int) -> None:
        with self._cond:
            g = self._gpu(gpu)
            g.recovery_action = action
            self._queue(g, EVENT_RECOVERY_ACTION, 0)
            self._save_faults()
            self._cond.notify_all()

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

    def _gpu(self, ref: str | int) -> _Gpu:
        return self._gpus[self.spec.gpu(str(ref)).index]

    def _queue(self, g: _Gpu, event_type: int, data: int) -> None:
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
        if self._faults_file is None:
            return
        gpus = {
            g.spec.uuid: {"lost": g.lost, "recoveryAction": g.recovery_action}
            for g in self._gpus
            if g.lost or g.recovery_action != RECOVERY_NONE
        }
        self._faults_file.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps({"version": 1, "gpus": gpus}, indent=2, sort_keys=True)
        fsutil.atomic_write(self._faults_file, data.encode())

    def _check_init(self) -> None:
        if self._refcount == 0:
            raise _Ret(UNINITIALIZED)

    def _dev(self, handle: Any, *, identity: bool = False) -> _Gpu:
        """The GPU a handle points at; GpuIsLost unless it is a static identity query."""
        self._check_init()
        g = self._by_address.get(_address(handle) or 0)
        if g is None:
            raise _Ret(INVALID_ARGUMENT)
        if g.lost and not (identity and not self._lost_hides_identity):
            raise _Ret(GPU_IS_LOST)
        return g

    def _export(self, impl: Callable[..., None]) -> Callable[..., int]:
        # A plain function (not a bound method): pynvml may set attributes such as restype.
        def symbol(*args: Any) -> int:
            with self._cond:
                try:
                    impl(*args)
                except _Ret as r:
                    return r.code
                return SUCCESS

        symbol.__name__ = impl.__name__.removeprefix("_sym_")
        return symbol

    def _build_library(self) -> SimpleNamespace:
        impls: list[Callable[..., None]] = [
            self._sym_nvmlInitWithFlags,
            self._sym_nvmlShutdown,
            self._sym_nvmlSystemGetDriverVersion,
            self._sym_nvmlSystemGetCudaDriverVersion,
            self._sym_nvmlSystemGetCudaDriverVersion_v2,
            self._sym_nvmlDeviceGetCount_v2,
            self._sym_nvmlDeviceGetHandleByIndex_v2,
            self._sym_nvmlDeviceGetHandleByUUID,
            self._sym_nvmlDeviceGetUUID,
            self._sym_nvmlDeviceGetName,
            self._sym_nvmlDeviceGetMemoryInfo,
            self._sym_nvmlDeviceGetMemoryInfo_v2,
            self._sym_nvmlDeviceGetMinorNumber,
            self._sym_nvmlDeviceGetPciInfo_v3,
            self._sym_nvmlDeviceGetCudaComputeCapability,
            self._sym_nvmlDeviceGetMigMode,
            self._sym_nvmlDeviceGetComputeMode,
            self._sym_nvmlDeviceSetComputeMode,
            self._sym_nvmlEventSetCreate,
            self._sym_nvmlEventSetFree,
            self._sym_nvmlDeviceGetSupportedEventTypes,
            self._sym_nvmlDeviceRegisterEvents,
            self._sym_nvmlEventSetWait_v2,
            self._sym_nvmlDeviceGetFieldValues,
            self._sym_nvmlDeviceGetComputeRunningProcesses_v3,
            self._sym_nvmlDeviceGetMPSComputeRunningProcesses_v3,
        ]
        if self.spec.memory_limits_symbol:
            impls += [
                self._sym_nvmlDeviceSetMemoryLimits_v1,
                self._sym_nvmlDeviceGetMemoryLimits_v1,
            ]
        lib = SimpleNamespace(**{f.__name__.removeprefix("_sym_"): self._export(f) for f in impls})

        def error_string(code: int) -> bytes:
            return _ERROR_STRINGS.get(int(code), b"Unknown Error")

        lib.nvmlErrorString = error_string  # plain function: pynvml sets its restype
        return lib

    # ---- C symbols (names are the symbols pynvml looks up) ---------------------------------

    def _sym_nvmlInitWithFlags(self, flags: int) -> None:
        if self._init_error is not None:
            raise _Ret(self._init_error)
        self._refcount += 1
        self._ever_initialized = True

    def _sym_nvmlShutdown(self) -> None:
        if not self._ever_initialized:
            raise _Ret(UNINITIALIZED)
        # Extra shutdowns are not an error (nvml.h, for backwards compatibility).
        self._refcount = max(0, self._refcount - 1)

    def _sym_nvmlSystemGetDriverVersion(self, buf: Any, length: Any) -> None:
        self._check_init()
        _write_string(buf, length, self.spec.driver_version)

    def _sym_nvmlSystemGetCudaDriverVersion(self, out: Any) -> None:
        self._check_init()
        out._obj.value = self.spec.cuda_driver_version

    def _sym_nvmlSystemGetCudaDriverVersion_v2(self, out: Any) -> None:
        self._sym_nvmlSystemGetCudaDriverVersion(out)

    def _sym_nvmlDeviceGetCount_v2(self, out: Any) -> None:
        self._check_init()
        out._obj.value = len(self._gpus)

    def _sym_nvmlDeviceGetHandleByIndex_v2(self, index: Any, out: Any) -> None:
        self._check_init()
        i = int(index.value)
        if i >= len(self._gpus):
            raise _Ret(INVALID_ARGUMENT)
        g = self._gpus[i]
        if g.lost and self._lost_hides_identity:
            raise _Ret(GPU_IS_LOST)
        _write_pointer(out._obj, g.address)

    def _sym_nvmlDeviceGetHandleByUUID(self, uuid: Any, out: Any) -> None:
        self._check_init()
        text = (uuid.value or b"").decode(errors="replace")
        if not text.startswith(("GPU-", "MIG-")):
            raise _Ret(INVALID_ARGUMENT)
        # NVML refuses this for every GPU while any GPU has fallen off the bus.
        if any(g.lost for g in self._gpus):
            raise _Ret(GPU_IS_LOST)
        for g in self._gpus:
            if g.spec.uuid == text:
                _write_pointer(out._obj, g.address)
                return
        raise _Ret(NOT_FOUND)

    def _sym_nvmlDeviceGetUUID(self, handle: Any, buf: Any, length: Any) -> None:
        _write_string(buf, length, self._dev(handle, identity=True).spec.uuid)

    def _sym_nvmlDeviceGetName(self, handle: Any, buf: Any, length: Any) -> None:
        _write_string(buf, length, self._dev(handle, identity=True).spec.name)

    def _used(self, g: _Gpu) -> int:
        return sum(g.processes.values()) + sum(g.mps_clients.values())

    def _sym_nvmlDeviceGetMemoryInfo(self, handle: Any, out: Any) -> None:
        g = self._dev(handle)
        mem = out._obj
        mem.total = g.spec.memory_total
        mem.used = g.spec.memory_reserved + self._used(g)  # v1 counts reserved as used
        mem.free = mem.total - mem.used

    def _sym_nvmlDeviceGetMemoryInfo_v2(self, handle: Any, out: Any) -> None:
        g = self._dev(handle)
        mem = out._obj
        if mem.version != MEMORY_V2:
            raise _Ret(ARGUMENT_VERSION_MISMATCH)
        mem.total = g.spec.memory_total
        mem.reserved = g.spec.memory_reserved
        mem.used = self._used(g)
        mem.free = mem.total - mem.reserved - mem.used

    def _sym_nvmlDeviceGetMinorNumber(self, handle: Any, out: Any) -> None:
        out._obj.value = self._dev(handle, identity=True).spec.minor

    def _sym_nvmlDeviceGetPciInfo_v3(self, handle: Any, out: Any) -> None:
        g = self._dev(handle, identity=True)
        info = out._obj
        domain, bus, rest = g.spec.pci_bus_id.split(":")
        device = rest.split(".")[0]
        info.busId = g.spec.pci_bus_id.encode()
        info.busIdLegacy = g.spec.pci_bus_id[4:].encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(device, 16)
        info.pciDeviceId = g.spec.pci_device_id
        info.pciSubSystemId = (0x1234 << 16) | 0x10DE

    def _sym_nvmlDeviceGetCudaComputeCapability(self, handle: Any, major: Any, minor: Any) -> None:
        g = self._dev(handle)
        major._obj.value, minor._obj.value = g.spec.compute_capability

    def _sym_nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> None:
        g = self._dev(handle)
        if not g.spec.mig_capable:
            raise _Ret(NOT_SUPPORTED)
        current._obj.value = pending._obj.value = int(g.spec.mig_enabled)

    def _sym_nvmlDeviceGetComputeMode(self, handle: Any, out: Any) -> None:
        out._obj.value = self._dev(handle).compute_mode

    def _sym_nvmlDeviceSetComputeMode(self, handle: Any, mode: Any) -> None:
        g = self._dev(handle)
        value = int(mode.value)
        if value == 1:
            raise _Ret(NOT_SUPPORTED)  # EXCLUSIVE_THREAD: support removed
        if value not in (0, 2, 3):
            raise _Ret(INVALID_ARGUMENT)
        if not self.spec.privileged:
            raise _Ret(NO_PERMISSION)
        g.compute_mode = value

    def _supported_events(self, g: _Gpu) -> int:
        mask = EVENT_PSTATE | EVENT_XID | EVENT_CLOCK
        if g.spec.ecc:
            mask |= EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC
        if self.spec.driver_branch >= RECOVERY_ACTION_BRANCH:
            mask |= EVENT_RECOVERY_ACTION
        return mask

    def _sym_nvmlEventSetCreate(self, out: Any) -> None:
        self._check_init()
        anchor = ctypes.create_string_buffer(8)
        self._sets[ctypes.addressof(anchor)] = _EventSet(anchor)
        _write_pointer(out._obj, ctypes.addressof(anchor))

    def _sym_nvmlEventSetFree(self, event_set: Any) -> None:
        self._check_init()
        if self._sets.pop(_address(event_set) or 0, None) is None:
            raise _Ret(INVALID_ARGUMENT)
        self._cond.notify_all()

    def _sym_nvmlDeviceGetSupportedEventTypes(self, handle: Any, out: Any) -> None:
        out._obj.value = self._supported_events(self._dev(handle))

    def _sym_nvmlDeviceRegisterEvents(self, handle: Any, mask: Any, event_set: Any) -> None:
        g = self._dev(handle)
        es = self._sets.get(_address(event_set) or 0)
        if es is None:
            raise _Ret(INVALID_ARGUMENT)
        wanted = int(mask.value)
        if wanted & ~self._supported_events(g):
            raise _Ret(NOT_SUPPORTED)  # and none of the requested types is registered
        es.masks[g.address] = es.masks.get(g.address, 0) | wanted

    def _sym_nvmlEventSetWait_v2(self, event_set: Any, out: Any, timeout_ms: Any) -> None:
        self._check_init()
        deadline = time.monotonic() + int(timeout_ms.value) / 1000.0
        while True:
            es = self._sets.get(_address(event_set) or 0)
            if es is None or self._refcount == 0:
                raise _Ret(INVALID_ARGUMENT if es is None else UNINITIALIZED)
            if es.queue:
                address, event_type, data = es.queue.popleft()
                ev = out._obj
                ev.device = ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlDevice_t)
                ev.eventType = event_type
                ev.eventData = data if event_type == EVENT_XID else 0
                ev.gpuInstanceId = NO_INSTANCE
                ev.computeInstanceId = NO_INSTANCE
                return
            if any(self._by_address[a].lost for a in es.masks):
                raise _Ret(GPU_IS_LOST)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Ret(TIMEOUT)
            self._cond.wait(remaining)

    def _sym_nvmlDeviceGetFieldValues(self, handle: Any, count: Any, out: Any) -> None:
        g = self._dev(handle)
        values = out._obj
        for i in range(int(count.value)):
            v = values[i]
            v.timestamp = time.time_ns() // 1000
            supported = self.spec.driver_branch >= RECOVERY_ACTION_BRANCH
            if v.fieldId in g.field_errors:
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                v.value.ullVal = 0
                v.nvmlReturn = g.field_errors[v.fieldId]
            elif v.fieldId == FIELD_RECOVERY_ACTION and supported:
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                v.value.uiVal = g.recovery_action
                v.nvmlReturn = SUCCESS
            else:
                v.nvmlReturn = NOT_SUPPORTED

    def _process_list(self, procs: dict[int, int], count: Any, array: Any) -> None:
        # The two-call protocol: a size query (INSUFFICIENT_SIZE + count), then the fill.
        needed = len(procs)
        c = count._obj
        if array is None or c.value < needed:
            c.value = needed
            if needed:
                raise _Ret(INSUFFICIENT_SIZE)
            return
        for i, (pid, mem) in enumerate(sorted(procs.items())):
            array[i].pid = pid
            array[i].usedGpuMemory = mem
            array[i].gpuInstanceId = NO_INSTANCE
            array[i].computeInstanceId = NO_INSTANCE
        c.value = needed

    def _sym_nvmlDeviceGetComputeRunningProcesses_v3(
        self, handle: Any, count: Any, array: Any
    ) -> None:
        self._process_list(self._dev(handle).processes, count, array)

    def _sym_nvmlDeviceGetMPSComputeRunningProcesses_v3(
        self, handle: Any, count: Any, array: Any
    ) -> None:
        self._process_list(self._dev(handle).mps_clients, count, array)

    def _sym_nvmlDeviceSetMemoryLimits_v1(self, handle: Any, limits: Any) -> None:
        g = self._dev(handle)
        req = limits._obj
        if not self.spec.privileged:
            raise _Ret(NO_PERMISSION)
        if g.spec.mig_enabled:
            raise _Ret(NOT_SUPPORTED)
        namespace = _text(req.nameSpace)
        if not namespace or req.softLimit > req.hardLimit:
            raise _Ret(INVALID_ARGUMENT)
        if req.softLimit == 0 and req.hardLimit == MEMORY_LIMIT_MAX:
            g.limits.pop(namespace, None)  # the documented way to clear
        else:
            g.limits[namespace] = (req.softLimit, req.hardLimit)

    def _sym_nvmlDeviceGetMemoryLimits_v1(self, handle: Any, limits: Any) -> None:
        g = self._dev(handle)
        req = limits._obj
        req.softLimit, req.hardLimit = g.limits.get(_text(req.nameSpace), (0, MEMORY_LIMIT_MAX))
        req.currentUsed = 0
