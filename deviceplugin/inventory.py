"""GPU inventory read through pynvml: frozen records, no policy.

Handles are resolved once per process and their addresses kept (`NvmlHandles`), so that an
event can be mapped back to its GPU even while NVML refuses `GetHandleByUUID` for every GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from deviceplugin.model import GpuUuid


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


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[Gpu, ...]
    node: NodeFacts

    def by_uuid(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)
