"""The C side of the fake NVML: the symbols pynvml calls, answered from the node's state.

Each exported attribute of `library` is a plain function named like the C symbol, returning an
int NVML return code and writing through ctypes out-params (reference nvml-mps-xid.md 2.7).
`FakeNvml` (nvml.py) holds the state these read and the control API that changes it.
Over 400 lines on purpose: a flat table of one small function per C symbol.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

from deviceplugin.simulate.specs import RECOVERY_ACTION_BRANCH, SimGpu, SimSpec

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
class GpuState:
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
class EventSet:
    anchor: Any
    masks: dict[int, int] = field(default_factory=dict)  # GPU handle address -> event mask
    queue: deque[tuple[int, int, int]] = field(default_factory=deque)  # (gpu, type, data)


class NvmlLibrary:
    """The C symbols over a node's GPUs; every call runs under `_cond`, as the driver's lock."""

    spec: SimSpec
    _cond: threading.Condition
    _refcount: int
    _ever_initialized: bool
    _init_error: int | None
    _lost_hides_identity: bool
    _gpus: list[GpuState]
    _by_address: dict[int, GpuState]
    _sets: dict[int, EventSet]

    def _check_init(self) -> None:
        if self._refcount == 0:
            raise _Ret(UNINITIALIZED)

    def _dev(self, handle: Any, *, identity: bool = False) -> GpuState:
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

    def _used(self, g: GpuState) -> int:
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

    def _supported_events(self, g: GpuState) -> int:
        mask = EVENT_PSTATE | EVENT_XID | EVENT_CLOCK
        if g.spec.ecc:
            mask |= EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC
        if self.spec.driver_branch >= RECOVERY_ACTION_BRANCH:
            mask |= EVENT_RECOVERY_ACTION
        return mask

    def _sym_nvmlEventSetCreate(self, out: Any) -> None:
        self._check_init()
        anchor = ctypes.create_string_buffer(8)
        self._sets[ctypes.addressof(anchor)] = EventSet(anchor)
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
