"""Hand-built plans for tests of the gRPC layer (the plan builder has its own tests)."""

from __future__ import annotations

from deviceplugin.inventory.gpus import Gpu
from deviceplugin.model import GIB, Enforcement, GpuUuid, Mode, ResourceName, slice_id
from deviceplugin.plan import GpuPlan, SlicePlan

RESOURCES = {
    Mode.TIME_SLICING: ResourceName("nvidia.com/gpu-fraction"),
    Mode.SM_SHARING: ResourceName("nvidia.com/gpu-fraction.sm-sharing"),
    Mode.EXCLUSIVE: ResourceName("nvidia.com/gpu"),
}


def gpu(index: int) -> Gpu:
    return Gpu(
        index=index,
        uuid=GpuUuid(f"GPU-0000000{index}-0000-4000-8000-00000000000{index}"),
        name="NVIDIA H200",
        memory_total=8 * GIB,
        minor=index,
        pci_bus_id=f"00000000:0{index}:00.0",
        numa_node=index % 2,
        compute_capability=(9, 0),
        mig_enabled=False,
        compute_mode=0,
    )


def gpu_plan(index: int, mode: Mode, slices: int = 4) -> GpuPlan:
    g = gpu(index)
    ids = (g.uuid,) if mode is Mode.EXCLUSIVE else tuple(slice_id(g.uuid, n) for n in range(slices))
    return GpuPlan(
        gpu=g,
        mode=mode,
        resource=RESOURCES[mode],
        slice_size=GIB,
        reserved=GIB,
        usable=7 * GIB,
        device_ids=ids,  # type: ignore[arg-type]
        enforcement=(Enforcement.CUDA_MEMORY_LIMITS,),
        reclaimable=False,
    )


def small_plan(*modes: Mode) -> SlicePlan:
    gpus = tuple(gpu_plan(i, m) for i, m in enumerate(modes))
    resources = tuple(sorted({p.resource for p in gpus}))
    return SlicePlan(gpus=gpus, resources=resources)
