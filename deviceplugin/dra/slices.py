"""Pure: the plan's DRA GPUs as `resource.k8s.io/v1` ResourceSlice bodies (DESIGN section 10).

One device per GPU (`gpu-<index>`), attributes under the driver's domain, capacity `memory`
multi-allocatable with a request policy on fractional GPUs (consumable capacity, KEP-5075),
plus `mpsClients` on sm-sharing ones (one per claim), the taints the publisher gives per
device, at most 128 devices per slice (64 with taints). The publisher decides the
generation, which devices wait for a health verdict, and writes them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deviceplugin.model import Mode
from deviceplugin.plan import GpuPlan, SlicePlan
from deviceplugin.quantity import format_quantity

DRIVER = "gpu-fraction.dev"
API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES = 128  # per slice (API validation)
MAX_DEVICES_WITH_TAINTS = 64  # per slice when any device has taints
MAX_NAME = 253
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpu-fraction-plugin"
MPS_CLIENTS = "mpsClients"  # consumable capacity: the MPS client slots of an sm-sharing GPU


@dataclass(frozen=True)
class Owner:
    """The Node the slices belong to: garbage-collected with it."""

    name: str
    uid: str


def device_name(gp: GpuPlan) -> str:
    return f"gpu-{gp.gpu.index}"


def version_attribute(text: str) -> str:
    """A semantic version from an NVML version string: numeric parts without leading zeros,
    padded to three (`615.43.02` → `615.43.2`, `9.0` → `9.0.0`)."""
    parts = [str(int(p)) for p in re.findall(r"[0-9]+", text)][:3]
    while len(parts) < 3:
        parts.append("0")
    return ".".join(parts)


def shareable_max(gp: GpuPlan) -> int:
    """M: the largest amount on the `min + n*step` grid (sliceSize steps) within usable memory."""
    return gp.slice_size * (gp.usable // gp.slice_size)


def memory_policy(gp: GpuPlan) -> dict[str, Any]:
    """The request policy of a fractional GPU's `memory`: a claim naming no amount gets the
    whole GPU's worth (M), never an overcommit. The API server refuses a `step` when
    `min + step` exceeds the capacity value (a GPU that holds one slice only), for the whole
    slice: such a GPU gets `{min: M, max: M}`, the same single amount without a step."""
    top = format_quantity(shareable_max(gp))
    valid: dict[str, str] = {"min": format_quantity(gp.slice_size)}
    if 2 * gp.slice_size <= gp.usable:
        valid["step"] = format_quantity(gp.slice_size)
    else:
        valid["min"] = top
    valid["max"] = top
    return {"default": top, "validRange": valid}


def device(
    gp: GpuPlan, driver_version: str, multi_allocation: bool, max_clients: int | None = None
) -> dict[str, Any]:
    """The ResourceSlice device of one GPU; `multi_allocation` False: never shared by claims
    (the API server dropped consumable capacity). `max_clients`: `mps.maxClients`, published
    on a shared sm-sharing GPU as the consumable `mpsClients`, one per claim, so the scheduler
    never allocates a share that prepare must refuse."""
    major, minor = gp.gpu.compute_capability
    attributes: dict[str, dict[str, Any]] = {
        "uuid": {"string": gp.uuid},
        "index": {"int": gp.gpu.index},
        "productName": {"string": gp.gpu.name},
        "mode": {"string": gp.mode.value},
        "enforcement": {"string": ",".join(e.value for e in gp.enforcement) or "none"},
        "driverVersion": {"version": version_attribute(driver_version)},
        "cudaComputeCapability": {"version": f"{major}.{minor}.0"},
    }
    if gp.gpu.numa_node is not None:
        attributes["numaNode"] = {"int": gp.gpu.numa_node}
    body: dict[str, Any] = {"name": device_name(gp), "attributes": attributes}
    if gp.mode is Mode.EXCLUSIVE or not multi_allocation:
        value = gp.usable if gp.mode is Mode.EXCLUSIVE else shareable_max(gp)
        body["capacity"] = {"memory": {"value": format_quantity(value)}}
        return body
    body["allowMultipleAllocations"] = True
    capacity: dict[str, Any] = {
        "memory": {"value": format_quantity(gp.usable), "requestPolicy": memory_policy(gp)}
    }
    if gp.mode is Mode.SM_SHARING and max_clients is not None:
        # Without a policy the allocator charges a claim that names no amount the whole value.
        capacity[MPS_CLIENTS] = {
            "value": str(max_clients),
            "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "1"}},
        }
    body["capacity"] = capacity
    return body


def devices(
    plan: SlicePlan,
    driver_version: str,
    multi_allocation: bool,
    taints: Mapping[str, Sequence[Mapping[str, str]]] | None = None,
    *,
    max_clients: int | None = None,
    withheld: Collection[str] = (),
) -> list[dict[str, Any]]:
    """Every DRA GPU's device in index order, with its taints (by device name) if any;
    `withheld` device names are left out (not yet judged healthy or not)."""
    out = []
    for gp in sorted(plan.dra_gpus, key=lambda gp: gp.gpu.index):
        if device_name(gp) in withheld:
            continue
        body = device(gp, driver_version, multi_allocation, max_clients)
        mine = (taints or {}).get(body["name"])
        if mine:
            body["taints"] = [dict(t) for t in mine]
        out.append(body)
    return out


def chunks(all_devices: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Devices split into slices of at most 128 (64 when any has taints); one empty slice for
    an empty pool, which still says the driver is alive."""
    size = MAX_DEVICES_WITH_TAINTS if any(d.get("taints") for d in all_devices) else MAX_DEVICES
    out = [list(all_devices[i : i + size]) for i in range(0, len(all_devices), size)]
    return out or [[]]


def slice_name(node: str, index: int, driver: str = DRIVER) -> str:
    """A stable name per (node, driver, index), a DNS subdomain of at most 253 characters."""
    name = f"{node}-{driver}-{index}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:16]
    return f"{node[: MAX_NAME - len(digest) - len(driver) - 24]}-{digest}-{driver}-{index}"


def build(
    plan: SlicePlan,
    *,
    owner: Owner,
    generation: int,
    driver_version: str,
    multi_allocation: bool = True,
    driver: str = DRIVER,
    taints: Mapping[str, Sequence[Mapping[str, str]]] | None = None,
    max_clients: int | None = None,
    withheld: Collection[str] = (),
) -> list[dict[str, Any]]:
    """Every ResourceSlice of this node's pool at `generation`, in name order."""
    parts = chunks(
        devices(
            plan, driver_version, multi_allocation, taints,
            max_clients=max_clients, withheld=withheld,
        )
    )  # fmt: skip
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {
                "name": slice_name(owner.name, i, driver),
                "labels": {MANAGED_BY_LABEL: MANAGED_BY},
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": owner.name,
                        "uid": owner.uid,
                        "controller": True,
                    }
                ],
            },
            "spec": {
                "driver": driver,
                "nodeName": owner.name,
                "pool": {
                    "name": owner.name,
                    "generation": generation,
                    "resourceSliceCount": len(parts),
                },
                "devices": part,
            },
        }
        for i, part in enumerate(parts)
    ]
