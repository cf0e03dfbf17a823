"""The plugin's one typed config: frozen dataclasses, loaded and validated in one place.

`load(path)` returns a `Config` or raises `ConfigError` listing every bad field by its path
(`gpus[1].mode: …`). Only this module reads config files and environment variables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deviceplugin.model import GIB, Mode, ResourceName


class ConfigError(Exception):
    """A config that failed validation; `problems` holds one `path: message` per bad field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class GpuMatch:
    index: int | None = None
    uuid: str | None = None
    product: str | None = None


@dataclass(frozen=True)
class GpuRule:
    match: GpuMatch
    mode: Mode
    slice_size: int | None = None  # bytes
    reserved_memory: int | None = None  # bytes


@dataclass(frozen=True)
class ResourceNames:
    # NewType calls are identity functions at run time; RUF009 does not know that.
    time_slicing: ResourceName = ResourceName("nvidia.com/gpu-fraction")  # noqa: RUF009
    sm_sharing: ResourceName = ResourceName("nvidia.com/gpu-fraction.sm-sharing")  # noqa: RUF009
    exclusive: ResourceName = ResourceName("nvidia.com/gpu")  # noqa: RUF009

    def for_mode(self, mode: Mode) -> ResourceName:
        return {
            Mode.TIME_SLICING: self.time_slicing,
            Mode.SM_SHARING: self.sm_sharing,
            Mode.EXCLUSIVE: self.exclusive,
        }[mode]


@dataclass(frozen=True)
class CdiConfig:
    driver_kind: str = "nvidia.com/gpu"
    nvidia_ctk_path: str = "/usr/bin/nvidia-ctk"
    driver_root: str = "/"


# Xid classes: reference/nvml-mps-xid.md section 4; DESIGN section 5.
DEFAULT_APPLICATION_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 69, 94)
DEFAULT_RESET_XIDS: tuple[int, ...] = (
    46, 48, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 158,
)  # fmt: skip
DEFAULT_REBOOT_XIDS: tuple[int, ...] = (79, 160)


@dataclass(frozen=True)
class HealthConfig:
    ignored_xids: tuple[int, ...] = ()
    application_xids: tuple[int, ...] = DEFAULT_APPLICATION_XIDS
    reset_xids: tuple[int, ...] = DEFAULT_RESET_XIDS
    reboot_xids: tuple[int, ...] = DEFAULT_REBOOT_XIDS
    quiet_period: float = 30.0  # seconds


@dataclass(frozen=True)
class MpsConfig:
    control_binary: str = "nvidia-cuda-mps-control"
    protocol_version: int = 2
    set_compute_mode: bool = True
    # 1..100, or None for "proportional" (the container's share of the GPU's slices)
    active_thread_percentage: int | None = 100
    max_clients: int = 48


@dataclass(frozen=True)
class Config:
    version: str = "v1"
    slice_size: int = GIB
    reserved_memory: int = GIB
    default_mode: Mode = Mode.TIME_SLICING
    resource_names: ResourceNames = field(default_factory=ResourceNames)
    gpus: tuple[GpuRule, ...] = ()
    enforcement: str = "required"  # required | best-effort
    ceilings: str = "reclaimable-only"  # reclaimable-only | allow-overcommit
    device_list_strategy: tuple[str, ...] = ("cdi",)  # cdi | envvar | device-nodes
    cdi: CdiConfig = field(default_factory=CdiConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    mps: MpsConfig = field(default_factory=MpsConfig)
