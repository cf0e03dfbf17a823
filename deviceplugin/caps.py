"""What a container gets for a share of a GPU: caps, ceilings, MPS wiring and hooks.

Computed once for both front-ends: the device-plugin Allocate and the DRA
NodePrepareResources call these functions and only differ in how they learn the request and
ceiling (counted slices and a guessed pod versus the claim's consumed capacity and config).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.config.settings import Config
from deviceplugin.model import MIB, Enforcement, GpuUuid, Mode
from deviceplugin.mps import layout
from deviceplugin.plan import GpuPlan

# Where a container finds its MPS server's shared memory: the GPU's shm dir is mounted here.
DEV_SHM = "/dev/shm"
ANNOTATION_PREFIX = "gpu-fraction.dev/"
# Driver device nodes a container needs besides its GPU's /dev/nvidia<minor>.
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")

Mount = tuple[str, str, bool]  # (container path, host path, read only)


@dataclass(frozen=True)
class Ceiling:
    """The applied limit and why: DESIGN section 4's `ceilings` policy, decided once."""

    limit: int  # bytes, >= the request
    source: str | None  # where a declared ceiling came from; None when nothing was declared
    policy: str | None  # applied | overcommit | ignored: no-reclaim; None without a ceiling


def apply_ceiling(
    config: Config, gp: GpuPlan, request: int, declared: int | None, source: str | None
) -> Ceiling:
    """The limit a declared ceiling (bytes, or None) earns on this GPU under `ceilings`."""
    if declared is None or declared <= request:
        return Ceiling(request, source, None)
    if config.ceilings == "allow-overcommit":
        policy = "overcommit"
    elif gp.reclaimable:
        policy = "applied"
    else:
        return Ceiling(request, source, "ignored: no-reclaim")
    return Ceiling(max(request, min(declared, gp.usable)), source, policy)


@dataclass(frozen=True)
class ContainerEdits:
    """Env, mounts, hooks and annotations (without prefix) for one share of one GPU."""

    env: dict[str, str]
    mounts: list[Mount] = field(default_factory=list)
    hooks: list[dict[str, object]] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)


def fractional_edits(
    config: Config,
    gp: GpuPlan,
    mps_root: Path,
    request: int,
    ceiling: Ceiling,
    active_threads: int | None,
) -> ContainerEdits:
    """The edits of a time-slicing or sm-sharing share of `request` bytes under `ceiling`."""
    request_mib, limit_mib = request // MIB, ceiling.limit // MIB
    env = {
        "NVIDIA_VISIBLE_DEVICES": gp.uuid,
        "NVIDIA_GPU_MEMORY_REQUEST": str(request_mib),
        "NVIDIA_GPU_MEMORY_LIMIT": str(limit_mib),
    }
    mounts: list[Mount] = []
    if gp.mode is Mode.SM_SHARING:
        mounts += mps_mounts(mps_root, gp.uuid)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(layout.pipe_dir(mps_root, gp.uuid))
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={limit_mib}M"
        if active_threads is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(active_threads)
    hooks: list[dict[str, object]] = []
    if Enforcement.CUDA_MEMORY_LIMITS in gp.enforcement:
        hooks.append(
            cdi_specs.memory_limit_hook(config.cdi.nvidia_ctk_path, config.cdi.driver_root, gp.uuid)
        )
    annotations = {
        "mode": gp.mode.value,
        "gpu": gp.uuid,
        "request": f"{request_mib}Mi",
        "limit": f"{limit_mib}Mi",
        "enforcement": ",".join(gp.enforcement),
    }
    if ceiling.source is not None:
        annotations["ceiling-source"] = ceiling.source
    if ceiling.policy is not None:
        annotations["ceiling-policy"] = ceiling.policy
    return ContainerEdits(env, mounts, hooks, annotations)


def mps_mounts(mps_root: Path, uuid: str) -> list[Mount]:
    """A client sees its daemon's world (DESIGN 3b): the pipe dir at the daemon's own path
    string (the MPS root is a host path mounted at that same path in the plugin), and the
    GPU's shm dir as its /dev/shm.

    The pipe dir is read-only: a client only connects to the daemon's sockets and opens its
    FIFOs, which a read-only mount allows (the kernel skips the mount's write check for
    sockets and FIFOs: af_unix's unix_find_bsd, fs/open.c do_dentry_open's special_file),
    while a root container can no longer plant or replace files the agent and the daemon
    read there (the pid file)."""
    pipe = str(layout.pipe_dir(mps_root, uuid))
    return [(pipe, pipe, True), (DEV_SHM, str(layout.shm_dir(mps_root, uuid)), False)]


def reclaimable(gp: GpuPlan, memory_accounting: Callable[[GpuUuid], bool] | None) -> GpuPlan:
    """`gp` as reclaimable only with proof: a protocol-3 plan is reclaimable in principle,
    and only a daemon whose memory accounting was read back `on` makes it so (DESIGN 3b)."""
    if not gp.reclaimable or gp.mode is not Mode.SM_SHARING:
        return gp
    if memory_accounting is not None and memory_accounting(gp.uuid):
        return gp
    return replace(gp, reclaimable=False)


def exclusive_edits(plans: list[GpuPlan]) -> ContainerEdits:
    """The edits of whole GPUs: only which GPUs the container sees."""
    uuids = ",".join(gp.uuid for gp in plans)
    return ContainerEdits(
        {"NVIDIA_VISIBLE_DEVICES": uuids}, annotations={"mode": Mode.EXCLUSIVE.value, "gpu": uuids}
    )


def proportional_threads(setting: int | None, count: int, total: int) -> int | None:
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for a share, or None to leave the daemon default.

    100 (the default) means no restriction, so no variable; `proportional` (None) is the
    share of the GPU's slices, rounded up, at least 1.
    """
    if setting is None:
        return max(1, math.ceil(100 * count / max(total, 1)))
    return setting if setting < 100 else None
