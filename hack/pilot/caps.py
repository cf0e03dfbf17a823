"""The pilot's caps, taken from the plugin: pod spec → slices → the plugin's Allocate → MiB.

A service's reservation and ceiling are what the plugin's own allocator grants for its pod on
a simulated H200 under the plugin's own config (`config.parse`, `plan.build_plan`,
`preferred.preferred` and `Allocator.allocate`, `quantity.parse_quantity`); nothing here
re-derives slice sizes, held-back memory or the ceiling rule.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deviceplugin.config import settings as plugin_config
from deviceplugin.dpapi.allocator import Allocator, CeilingDecision, Grant
from deviceplugin.dpapi.preferred import preferred
from deviceplugin.health.board import HealthBoard
from deviceplugin.inventory.gpus import Inventory
from deviceplugin.ledger.store import Ledger
from deviceplugin.model import MIB, GpuUuid, Mode, ResourceName
from deviceplugin.plan import SlicePlan
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
    return load_spec(preset).inventory()


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


class DeclaredCeiling:
    """The plugin's CeilingSource, answering with the one ceiling the pod declared."""

    def __init__(self, limit: int | None, source: str) -> None:
        self.limit = limit
        self.source = source

    def ceiling_for(self, resource: ResourceName, count: int, gpu: GpuUuid) -> CeilingDecision:
        return CeilingDecision(self.limit, self.source if self.limit is not None else None)


def plugin_allocate(
    plan: SlicePlan,
    cfg: plugin_config.Config,
    resource: str,
    count: int,
    ceiling: DeclaredCeiling,
    state_dir: Path,
    mps_root: Path,
) -> Grant:
    """The plugin's own answer for `count` devices of `resource`: GetPreferredAllocation's
    pick, then Allocate (files it writes go under `state_dir`)."""
    available = [d for gp in plan.for_resource(resource) for d in gp.device_ids]
    ids = preferred(plan, resource, available, [], count)
    allocator = Allocator(
        plan_source=lambda: plan,
        config_source=lambda: cfg,
        cdi_dir=state_dir / "cdi",
        mps_root=mps_root,
        ledger=Ledger(state_dir / "state"),
        board=HealthBoard(),
        mps=None,
        ceilings=ceiling,
    )
    return allocator.allocate(resource, ids)


def caps_for_pod(pod: Mapping[str, Any], plan: SlicePlan, cfg: plugin_config.Config) -> ServiceCaps:
    """The request and limit the plugin applies to the pod's container on its GPU."""
    container, resource, count = container_request(pod, plan)
    gpus = plan.for_resource(resource)
    if not gpus:
        raise PodSpecError(f"no GPU serves {resource}")
    name = str(pod.get("metadata", {}).get("name", ""))
    annotations = pod.get("metadata", {}).get("annotations", {})
    declared = annotations.get(CEILING_ANNOTATION.format(container=container))
    ceiling = DeclaredCeiling(
        parse_quantity(declared) if declared is not None else None, f"pod {name}"
    )
    with tempfile.TemporaryDirectory(prefix="pilot-caps-") as tmp:
        grant = plugin_allocate(plan, cfg, resource, count, ceiling, Path(tmp), Path(tmp) / "mps")
    rec = grant.record
    gp = plan.for_gpu(rec.gpus[0])
    assert gp is not None
    if rec.request_mib is None or rec.limit_mib is None:  # exclusive: the whole GPU(s), uncapped
        request_mib = limit_mib = sum(g.usable for g in gpus[: len(rec.gpus)]) // MIB
        note = "whole GPU, no cap"
    else:
        request_mib, limit_mib = rec.request_mib, rec.limit_mib
        note = _ceiling_note(declared, rec.ceiling_policy, limit_mib)
    return ServiceCaps(
        pod=name,
        container=container,
        resource=resource,
        mode=rec.mode,
        devices=count,
        request_mib=request_mib,
        limit_mib=limit_mib,
        gpu_total_mib=gp.gpu.memory_total // MIB,
        gpu_usable_mib=gp.usable // MIB,
        enforcement=tuple(str(e) for e in rec.enforcement),
        ceiling_note=note,
    )


def _ceiling_note(declared: str | None, policy: str | None, limit: int) -> str:
    if declared is None:
        return "none declared: limit = request"
    if policy is None:
        return "not above the request: limit = request"
    if policy.startswith("ignored"):
        return f"{policy} (limit = request)"
    clamped = parse_quantity(declared) // MIB > limit
    return f"honoured ({policy})" + (", clamped to the GPU's usable memory" if clamped else "")
