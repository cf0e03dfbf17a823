"""GPU inventory read through pynvml: frozen records, no policy.

`read_inventory` reads every GPU of an `NvmlSession` (which resolves handles once and keeps
their addresses) plus the node facts; a lost GPU is listed as lost and the others still read.
In simulation the node facts come from the spec, never from the host.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pynvml

from deviceplugin.inventory.nvml import Handle, NvmlSession
from deviceplugin.model import GpuUuid

_T = TypeVar("_T")

# Driver branch from which CUDA per-cgroup memory limits exist (r615, CUDA 13.4).
MEMORY_LIMITS_BRANCH = 615
HOOK_PROBE_TIMEOUT = 5.0


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: GpuUuid
    name: str
    memory_total: int  # bytes
    minor: int  # /dev/nvidia<minor>
    pci_bus_id: str
    numa_node: int | None  # None: the platform reports no NUMA affinity (-1)
    compute_capability: tuple[int, int]
    mig_enabled: bool  # False also when the GPU cannot do MIG
    compute_mode: int  # NVML_COMPUTEMODE_*
    lost: bool = False


@dataclass(frozen=True)
class NodeFacts:
    """Facts about the node outside NVML; in simulation they come from the spec."""

    driver_version: str
    cuda_driver_version: int  # e.g. 13040 for CUDA 13.4
    cuda_memory_limits: bool  # driver branch >= 615 and nvmlDeviceSetMemoryLimits_v1 present
    cgroup_v2: bool
    nvidia_ctk_present: bool  # the host's nvidia-ctk exists at cdi.nvidiaCtkPath
    # `nvidia-ctk hook apply-cuda-memory-limits --help` exits 0 (toolkit 1.20.1+)
    memory_limits_hook: bool = True


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[Gpu, ...]
    node: NodeFacts

    def by_uuid(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)


class InventoryError(Exception):
    """The inventory could not be read (NVML failed for a reason other than a lost GPU)."""


def sysfs_pci_name(bus_id: str) -> str:
    """NVML's "00000000:3B:00.0" as sysfs names the device: "0000:3b:00.0"."""
    domain, _, rest = bus_id.partition(":")
    return f"{domain[-4:]}:{rest}".lower()


def read_numa_node(sysfs_root: Path, bus_id: str) -> int | None:
    """The GPU's NUMA node from sysfs; None when absent, unreadable or -1 (no affinity)."""
    path = sysfs_root / "bus" / "pci" / "devices" / sysfs_pci_name(bus_id) / "numa_node"
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def driver_branch(driver_version: str) -> int:
    try:
        return int(driver_version.split(".", 1)[0])
    except ValueError:
        return 0


def on_host(host_root: Path, host_path: str) -> Path:
    """Where the host's absolute `host_path` is visible in this process (`--host-root`)."""
    return host_root / host_path.lstrip("/")


def read_driver_version() -> str:
    """The driver version NVML reports now (a reload compares it with the inventory's)."""
    try:
        return str(pynvml.nvmlSystemGetDriverVersion())
    except pynvml.NVMLError as err:
        raise InventoryError(f"reading the driver version: {err}") from None


def read_node_facts(
    session: NvmlSession, sysfs_root: Path, nvidia_ctk_path: str, host_root: Path = Path("/")
) -> NodeFacts:
    """Node facts of a real node: driver and CUDA versions from NVML, the rest from the host.

    `nvidia_ctk_path` is a host path (the runtime runs the hook on the host): it is looked up
    under `host_root`, so a node without the binary there still starts (nothing mounts it).
    """
    del session  # NVML is initialised by the session; the calls below are process-wide
    try:
        driver = str(pynvml.nvmlSystemGetDriverVersion())
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())
    except pynvml.NVMLError as err:
        raise InventoryError(f"reading driver versions: {err}") from None
    ctk = on_host(host_root, nvidia_ctk_path)
    present = ctk.is_file() and os.access(ctk, os.X_OK)
    return NodeFacts(
        driver_version=driver,
        cuda_driver_version=cuda,
        cuda_memory_limits=driver_branch(driver) >= MEMORY_LIMITS_BRANCH and _has_limits_symbol(),
        cgroup_v2=(sysfs_root / "fs" / "cgroup" / "cgroup.controllers").is_file(),
        nvidia_ctk_present=present,
        memory_limits_hook=present and probe_memory_limits_hook(str(ctk)),
    )


def probe_memory_limits_hook(nvidia_ctk_path: str, timeout: float = HOOK_PROBE_TIMEOUT) -> bool:
    """Whether `<nvidia-ctk> hook apply-cuda-memory-limits --help` exits 0: a toolkit older
    than 1.20.1 lacks the hook, and a container whose spec names it fails to start."""
    argv = [nvidia_ctk_path, "hook", "apply-cuda-memory-limits", "--help"]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _has_limits_symbol() -> bool:
    try:
        pynvml._nvmlGetFunctionPointer("nvmlDeviceSetMemoryLimits_v1")
    except pynvml.NVMLError:
        return False
    return True


def read_inventory(
    session: NvmlSession,
    sysfs_root: Path,
    nvidia_ctk_path: str,
    node_facts: NodeFacts | None = None,
    host_root: Path = Path("/"),
) -> Inventory:
    """Every GPU of the session plus the node facts (`node_facts` given: simulation's spec).

    A lost GPU is listed with `lost=True` and whatever it still answers; the others read
    normally. A GPU lost before its UUID could be read gets a placeholder UUID.
    """
    node = node_facts or read_node_facts(session, sysfs_root, nvidia_ctk_path, host_root)
    gpus: dict[int, Gpu] = {}
    for uuid, handle in session.handles().items():
        index = session.index_of(uuid)
        gpus[index] = _read_gpu(index, uuid, handle, sysfs_root)
    for index in session.lost_indices:
        gpus[index] = Gpu(
            index=index,
            uuid=GpuUuid(f"GPU-lost-index-{index}"),
            name="unknown (GPU lost)",
            memory_total=0,
            minor=-1,
            pci_bus_id="",
            numa_node=None,
            compute_capability=(0, 0),
            mig_enabled=False,
            compute_mode=0,
            lost=True,
        )
    return Inventory(gpus=tuple(gpus[i] for i in sorted(gpus)), node=node)


class _Reader:
    """Reads one GPU's fields, turning GpuIsLost into a default and a `lost` mark."""

    def __init__(self, uuid: GpuUuid) -> None:
        self.uuid = uuid
        self.lost = False

    def get(self, what: str, call: Callable[[], _T], default: _T) -> _T:
        try:
            return call()
        except pynvml.NVMLError_GpuIsLost:
            self.lost = True
            return default
        except pynvml.NVMLError as err:
            raise InventoryError(f"GPU {self.uuid}: reading {what}: {err}") from None


def _read_gpu(index: int, uuid: GpuUuid, handle: Handle, sysfs_root: Path) -> Gpu:
    r = _Reader(uuid)
    bus_id = r.get("PCI info", lambda: str(pynvml.nvmlDeviceGetPciInfo(handle).busId), "")
    cc = r.get("compute capability", lambda: _cc(handle), (0, 0))
    return Gpu(
        index=index,
        uuid=uuid,
        name=r.get("name", lambda: str(pynvml.nvmlDeviceGetName(handle)), "unknown"),
        memory_total=r.get("memory", lambda: _memory_total(handle), 0),
        minor=r.get("minor number", lambda: int(pynvml.nvmlDeviceGetMinorNumber(handle)), -1),
        pci_bus_id=bus_id,
        numa_node=read_numa_node(sysfs_root, bus_id) if bus_id else None,
        compute_capability=cc,
        mig_enabled=r.get("MIG mode", lambda: _mig_enabled(handle), False),
        compute_mode=r.get("compute mode", lambda: _compute_mode(handle), 0),
        lost=r.lost,
    )


def _cc(handle: Handle) -> tuple[int, int]:
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    return (int(major), int(minor))


def _compute_mode(handle: Handle) -> int:
    return int(pynvml.nvmlDeviceGetComputeMode(handle))


def _memory_total(handle: Handle) -> int:
    """Total bytes from memory info v2 where the driver has it, else v1."""
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).total)
    except (
        pynvml.NVMLError_FunctionNotFound,
        pynvml.NVMLError_NotSupported,
        pynvml.NVMLError_ArgumentVersionMismatch,
    ):
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)


def _mig_enabled(handle: Handle) -> bool:
    """Current MIG mode; NotSupported means the GPU cannot do MIG, which is not an error."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:
        return False
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)
