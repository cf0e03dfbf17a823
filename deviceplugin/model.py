"""Identifiers and enums shared by every layer.

NewType ids keep GPU UUIDs, slice IDs and resource names apart in type checks; the enums'
values are the strings users see in config, logs, records and the kubelet API.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NewType

GpuUuid = NewType("GpuUuid", str)
SliceId = NewType("SliceId", str)
ResourceName = NewType("ResourceName", str)

MIB = 1024 * 1024
GIB = 1024 * MIB

# The kubelet's own limits (reference/kubelet-wire-facts.md).
MAX_DEVICE_ID_LEN = 63
KUBELET_MAX_MESSAGE = 4 * MIB
# Our own ceiling for one ListAndWatch message, well under the kubelet's 4 MiB.
MAX_LIST_AND_WATCH_BYTES = 1 * MIB


class Mode(StrEnum):
    TIME_SLICING = "time-slicing"
    SM_SHARING = "sm-sharing"
    EXCLUSIVE = "exclusive"


class ServingApi(StrEnum):
    """Which front-end hands a GPU out; exactly one per GPU (DESIGN section 10)."""

    DEVICE_PLUGIN = "device-plugin"
    DRA = "dra"


class Health(StrEnum):
    """Exactly the kubelet's strings; anything else counts as unhealthy there."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


class Enforcement(StrEnum):
    CUDA_MEMORY_LIMITS = "cuda-memory-limits"
    MPS_PINNED_LIMIT = "mps-pinned-limit"
    NONE = "none"


class Delivery(StrEnum):
    """How the caps reach the container: a CDI edit (applied after the pod's env) or plain env."""

    CDI = "cdi-edit"
    ENV = "plain-env"


class FaultDomain(StrEnum):
    """What one fault takes down (DESIGN section 5).

    GPU and MONITOR take every slice of the GPU; MPS_SERVER and MPS_DAEMON take the GPU's
    sm-sharing slices only; CLIENT_LIMIT takes only the free sm-sharing slices of a GPU that
    has reached `mps.maxClients`.
    """

    GPU = "gpu"
    MONITOR = "monitor"
    MPS_SERVER = "mps-server"
    MPS_DAEMON = "mps-daemon"
    CLIENT_LIMIT = "client-limit"


GPU_WIDE_DOMAINS = frozenset({FaultDomain.GPU, FaultDomain.MONITOR})
MPS_DOMAINS = frozenset({FaultDomain.MPS_SERVER, FaultDomain.MPS_DAEMON})


def slice_id(gpu: GpuUuid, index: int) -> SliceId:
    return SliceId(f"{gpu}::{index}")


def gpu_of(device_id: str) -> str:
    """The GPU part of a device ID, unchecked: `GPU-x::3` → `GPU-x`, a bare UUID → itself."""
    return device_id.partition("::")[0]


def split_slice_id(device_id: str) -> tuple[GpuUuid, int | None]:
    """`GPU-x::3` → (GPU-x, 3); a bare UUID (exclusive device) → (uuid, None)."""
    gpu, sep, index = device_id.partition("::")
    if not sep:
        return GpuUuid(device_id), None
    if not index.isdigit() or (len(index) > 1 and index.startswith("0")):
        raise ValueError(f"malformed slice id {device_id!r}")
    return GpuUuid(gpu), int(index)
