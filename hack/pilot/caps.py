"""The pilot's caps, taken from the plugin: pod spec → slices → the plugin's plan → MiB.

A service's reservation and ceiling are what the plugin would grant for its pod on a simulated
H200 under the plugin's own config (`deviceplugin.config.parse`, `plan.build_plan`,
`quantity.parse_quantity`); nothing here re-derives slice sizes or held-back memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deviceplugin import config as plugin_config
from deviceplugin.inventory import Gpu, Inventory
from deviceplugin.model import MIB, Mode
from deviceplugin.plan import GpuPlan, SlicePlan
from deviceplugin.quantity import parse_quantity
from deviceplugin.simulate.specs import load_spec

# The annotation KAI Scheduler and the GPU Fractioning Operator use (DESIGN section 4).
CEILING_ANNOTATION = "nvidia.com/container.{container}.gpu-memory.limit"


class PodSpecError(ValueError):
    """A pod spec the pilot cannot turn into caps."""


@dataclass(frozen=True)
class ServiceCaps:
    pod: str
    container: str
    resource: str
    mode: Mode
    devices: int  # slices (or whole GPUs) asked for
    request_mib: int
    limit_mib: int
    gpu_total_mib: int
    gpu_usable_mib: int  # what the plan advertises on that GPU, after its reserve
    enforcement: tuple[str, ...]
    ceiling_note: str  # how the declared ceiling was treated


def plugin_config_for(mode: Mode, ceilings: str = "reclaimable-only") -> plugin_config.Config:
    """The plugin's config for the pilot's GPU: its defaults plus mode, ceiling policy and a
    hands-off MPS setting (the pilot never changes a GPU's compute mode)."""
    return plugin_config.parse(
        {
            "version": "v1",
            "defaultMode": str(mode),
            "ceilings": ceilings,
            "mps": {"setComputeMode": False},
        }
    )


def simulated_inventory(preset: str = "h200x2") -> Inventory:
    """The preset node's GPUs as inventory records (the same facts the fake NVML serves)."""
    spec = load_spec(preset)
    gpus = tuple(
        Gpu(
            index=g.index,
            uuid=g.uuid,
            name=g.name,
            memory_total=g.memory_total,
            minor=g.minor,
            pci_bus_id=g.pci_bus_id,
            numa_node=g.numa_node,
            compute_capability=g.compute_capability,
            mig_enabled=g.mig_enabled,
            compute_mode=g.compute_mode,
        )
        for g in spec.gpus
    )
    return Inventory(gpus, spec.node_facts())


def container_request(pod: Mapping[str, Any], plan: SlicePlan) -> tuple[str, str, int]:
    """(container name, resource, count) of the one container asking for a served resource."""
    containers = pod.get("spec", {}).get("containers", [])
    found = []
    for c in containers:
        limits = c.get("resources", {}).get("limits", {})
        for resource, count in limits.items():
            if resource in plan.resources:
                found.append((str(c["name"]), str(resource), int(count)))
    if len(found) != 1:
        raise PodSpecError(f"pod needs exactly one container limit of {plan.resources}: {found}")
    return found[0]


def caps_for_pod(pod: Mapping[str, Any], plan: SlicePlan, cfg: plugin_config.Config) -> ServiceCaps:
    """The request and limit the plugin applies to the pod's container on its GPU."""
    container, resource, count = container_request(pod, plan)
    gpus = plan.for_resource(resource)
    if not gpus:
        raise PodSpecError(f"no GPU serves {resource}")
    gp = gpus[0]
    annotations = pod.get("metadata", {}).get("annotations", {})
    declared = annotations.get(CEILING_ANNOTATION.format(container=container))
    ceiling = parse_quantity(declared) if declared is not None else None
    request, limit, note = _granted(gp, cfg, count, ceiling)
    return ServiceCaps(
        pod=str(pod.get("metadata", {}).get("name", "")),
        container=container,
        resource=resource,
        mode=gp.mode,
        devices=count,
        request_mib=request // MIB,
        limit_mib=limit // MIB,
        gpu_total_mib=gp.gpu.memory_total // MIB,
        gpu_usable_mib=gp.usable // MIB,
        enforcement=tuple(str(e) for e in gp.enforcement),
        ceiling_note=note,
    )


def _granted(
    gp: GpuPlan, cfg: plugin_config.Config, count: int, ceiling: int | None
) -> tuple[int, int, str]:
    """(request, limit, note) in bytes, as DESIGN section 4 has the allocator decide them.

    The one place to swap for `deviceplugin.allocator` once its ceiling handling lands."""
    if gp.mode is Mode.EXCLUSIVE:
        return gp.usable * count, gp.usable * count, "whole GPU"
    request = count * gp.slice_size
    if ceiling is None:
        return request, request, "none declared: limit = request"
    if cfg.ceilings == "allow-overcommit" or gp.reclaimable:
        limit = min(max(ceiling, request), gp.usable)
        return request, limit, "honoured (overcommit)" if not gp.reclaimable else "honoured"
    return request, request, "ignored: no-reclaim (limit = request)"
