"""One NVML session per process: init once, resolve every GPU's handle once, shut down once.

Everything is keyed by GPU UUID; handles are never compared by identity (two pynvml handles
for one GPU compare unequal). Handle addresses are kept so that an event's device maps back
to its GPU even while NVML refuses `GetHandleByUUID` for every GPU (one has fallen off the bus).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import pynvml

from deviceplugin.model import GpuUuid
from deviceplugin.plumbing import logs

_log = logs.get("nvml")
# Whole-call answers of a driver that cannot read fields at all: no value, not a fault.
_NO_FIELD_CALL = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    }
)

NO_DRIVER_MESSAGE = (
    "no NVIDIA driver found on this node; use --simulate PRESET to run on simulated GPUs"
)
FIELD_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION

Handle = Any  # a pynvml c_nvmlDevice_t pointer; opaque


class NvmlError(Exception):
    """An NVML call failed; `code` is the NVML return code when there is one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class NvmlUnavailable(NvmlError):
    """No driver or no NVML library on this node."""


class GpuLost(NvmlError):
    """The GPU has fallen off the bus (NVML_ERROR_GPU_IS_LOST)."""


class NoPermission(NvmlError):
    """The call needs root (e.g. setting a compute mode)."""


class UnknownGpu(NvmlError):
    """No GPU with this UUID in the session."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory: int | None  # bytes; None when NVML cannot tell
    mps_client: bool


def handle_address(handle: Handle) -> int | None:
    """The device address a handle holds: the only safe way to compare handles."""
    value: int | None = ctypes.cast(handle, ctypes.c_void_p).value
    return value


def wrap(err: pynvml.NVMLError, what: str) -> NvmlError:
    """Turn a pynvml error into one of ours, with context."""
    code = int(err.value)
    msg = f"{what}: {err}"
    if code == pynvml.NVML_ERROR_GPU_IS_LOST:
        return GpuLost(msg, code)
    if code == pynvml.NVML_ERROR_NO_PERMISSION:
        return NoPermission(msg + " (needs root: run the plugin privileged)", code)
    if code in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
        return NvmlUnavailable(NO_DRIVER_MESSAGE, code)
    return NvmlError(msg, code)


class NvmlSession:
    """NVML initialised once, with every GPU's handle resolved once.

    `open()` raises NvmlUnavailable (message NO_DRIVER_MESSAGE) on a node without a driver.
    GPUs whose handle or UUID cannot be read because they are lost are listed in `lost_indices`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = False
        self._handles: dict[GpuUuid, Handle] = {}
        self._by_address: dict[int, GpuUuid] = {}
        self._indices: dict[GpuUuid, int] = {}
        self.lost_indices: tuple[int, ...] = ()
        self.device_count = 0

    @classmethod
    def open(cls) -> NvmlSession:
        session = cls()
        session._start()
        return session

    def _start(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise wrap(err, "nvmlInit") from None
        self._open = True
        try:
            self.device_count = int(pynvml.nvmlDeviceGetCount())
            lost: list[int] = []
            for index in range(self.device_count):
                try:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                    uuid = GpuUuid(pynvml.nvmlDeviceGetUUID(handle))
                except pynvml.NVMLError_GpuIsLost:
                    lost.append(index)
                    logs.log(_log, "gpu lost at start; no identity", index=index)
                    continue
                self._handles[uuid] = handle
                self._indices[uuid] = index
                address = handle_address(handle)
                if address is not None:
                    self._by_address[address] = uuid
            self.lost_indices = tuple(lost)
        except pynvml.NVMLError as err:
            self.shutdown()
            raise wrap(err, "enumerating GPUs") from None

    def shutdown(self) -> None:
        """Shut NVML down once; later calls do nothing."""
        with self._lock:
            if not self._open:
                return
            self._open = False
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as err:
            logs.log(_log, "nvmlShutdown failed", error=str(err))

    def __enter__(self) -> NvmlSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- lookups ----------------------------------------------------------------------------

    def handles(self) -> dict[GpuUuid, Handle]:
        """UUID -> handle, in device-index order."""
        return dict(self._handles)

    def index_of(self, uuid: GpuUuid) -> int:
        self.handle(uuid)
        return self._indices[uuid]

    def handle(self, uuid: GpuUuid) -> Handle:
        try:
            return self._handles[uuid]
        except KeyError:
            raise UnknownGpu(f"no GPU {uuid} on this node") from None

    def uuid_for_handle(self, handle: Handle) -> GpuUuid | None:
        """The GPU an event's device handle belongs to, by address; None if unknown."""
        address = handle_address(handle)
        return self._by_address.get(address) if address is not None else None

    # ---- per-GPU calls ----------------------------------------------------------------------

    def get_compute_mode(self, uuid: GpuUuid) -> int:
        try:
            return int(pynvml.nvmlDeviceGetComputeMode(self.handle(uuid)))
        except pynvml.NVMLError as err:
            raise wrap(err, f"reading compute mode of {uuid}") from None

    def set_compute_mode(self, uuid: GpuUuid, mode: int) -> None:
        """Raises NoPermission when not root (the plugin must run privileged)."""
        try:
            pynvml.nvmlDeviceSetComputeMode(self.handle(uuid), mode)
        except pynvml.NVMLError as err:
            raise wrap(err, f"setting compute mode {mode} on {uuid}") from None

    def recovery_action(self, uuid: GpuUuid) -> int | None:
        """NVML_GPU_RECOVERY_ACTION_* from field 230; None where it has no value: a driver
        without the field, or any error in the field's own status (the call succeeds if any
        field was filled, so each entry carries its own `nvmlReturn`). Only a failure of the
        call itself (a lost GPU) raises."""
        try:
            values = pynvml.nvmlDeviceGetFieldValues(self.handle(uuid), [FIELD_RECOVERY_ACTION])
        except pynvml.NVMLError as err:
            if err.value in _NO_FIELD_CALL:
                return None
            raise wrap(err, f"reading recovery action of {uuid}") from None
        entry = values[0]
        if entry.nvmlReturn != pynvml.NVML_SUCCESS:
            if entry.nvmlReturn != pynvml.NVML_ERROR_NOT_SUPPORTED:
                logs.log(_log, "recovery action field unreadable", gpu=uuid,
                         error=str(pynvml.NVMLError(entry.nvmlReturn)))  # fmt: skip
            return None
        return int(entry.value.uiVal)

    def probe(self, uuid: GpuUuid) -> bool:
        """True when the GPU answers a dynamic query (memory info); False when it is lost."""
        try:
            pynvml.nvmlDeviceGetMemoryInfo(self.handle(uuid))
        except pynvml.NVMLError as err:
            logs.log(_log, "gpu probe failed", gpu=uuid, error=str(err))
            return False
        return True

    def running_processes(self, uuid: GpuUuid) -> list[GpuProcess]:
        """Compute processes plus MPS clients; an old driver without the _v3 calls gives []."""
        handle = self.handle(uuid)
        out: list[GpuProcess] = []
        calls = (
            (pynvml.nvmlDeviceGetComputeRunningProcesses, False),
            (pynvml.nvmlDeviceGetMPSComputeRunningProcesses, True),
        )
        for call, mps in calls:
            try:
                procs = _retry_insufficient(call, handle)
            except pynvml.NVMLLibraryMismatchError as err:
                # Not an NVMLError subclass: the driver predates the _v3 process calls.
                logs.log(_log, "process list unavailable", gpu=uuid, error=str(err))
                continue
            except pynvml.NVMLError as err:
                if err.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                    continue
                raise wrap(err, f"listing processes on {uuid}") from None
            out.extend(GpuProcess(int(p.pid), p.usedGpuMemory, mps) for p in procs)
        return out


def _retry_insufficient(call: Any, handle: Any, attempts: int = 3) -> Any:
    """The two-call process-list protocol races with processes starting in between: retry."""
    for attempt in range(attempts):
        try:
            return call(handle)
        except pynvml.NVMLError as err:
            if err.value != pynvml.NVML_ERROR_INSUFFICIENT_SIZE or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
