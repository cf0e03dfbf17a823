"""SlicePlan: a pure function of (Inventory, Config) saying what each GPU advertises.

Everything else reads the plan; nothing recomputes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from deviceplugin.inventory import Gpu
from deviceplugin.model import Enforcement, GpuUuid, Mode, ResourceName, SliceId


@dataclass(frozen=True)
class GpuPlan:
    gpu: Gpu
    mode: Mode
    resource: ResourceName
    slice_size: int  # bytes; for exclusive GPUs the usable memory
    reserved: int  # bytes held back
    usable: int  # bytes = total - reserved
    device_ids: tuple[SliceId, ...]  # empty when not advertised
    enforcement: tuple[Enforcement, ...]
    reclaimable: bool  # borrowed memory above a request can be reclaimed (DESIGN section 4)
    skipped: str | None = None  # why the GPU is not advertised, or None

    @property
    def advertised(self) -> bool:
        return self.skipped is None and bool(self.device_ids)

    @property
    def uuid(self) -> GpuUuid:
        return self.gpu.uuid


@dataclass(frozen=True)
class SlicePlan:
    gpus: tuple[GpuPlan, ...]
    resources: tuple[ResourceName, ...]  # resource names served, in a stable order

    def for_resource(self, resource: str) -> tuple[GpuPlan, ...]:
        return tuple(p for p in self.gpus if p.advertised and p.resource == resource)

    def for_gpu(self, uuid: str) -> GpuPlan | None:
        return next((p for p in self.gpus if p.uuid == uuid), None)
