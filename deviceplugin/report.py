"""What `gpu-fraction-plugin inventory` prints: a stable JSON form and a readable table.

`inventory_report` turns an Inventory (and the SlicePlan, once there is one) into plain data
with a fixed key order; `format_inventory_table` renders that data. Plan-dependent columns
show "-" without a plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from deviceplugin.inventory.gpus import Inventory
from deviceplugin.model import MIB, GpuUuid, Health
from deviceplugin.plan import SlicePlan

COMPUTE_MODE_NAMES = {0: "Default", 1: "ExclusiveThread", 2: "Prohibited", 3: "ExclusiveProcess"}


def _cuda(version: int) -> str:
    return f"{version // 1000}.{(version % 1000) // 10}"


def inventory_report(
    inventory: Inventory,
    plan: SlicePlan | None,
    health: Mapping[GpuUuid, str] | None = None,
    dra: Mapping[str, Any] | None = None,
    cuda_limits_unmet: Sequence[str] = (),
) -> dict[str, Any]:
    """Plain data for `--json`; `health` overrides the per-GPU health (default: lost or not);
    `dra`: whether the plan's DRA GPUs are served, and why not (key `dra`, when given);
    `cuda_limits_unmet`: the failed conditions of `cuda-memory-limits`."""
    node = inventory.node
    gpus = []
    for g in inventory.gpus:
        p = plan.for_gpu(g.uuid) if plan is not None else None
        default_health = Health.UNHEALTHY if g.lost else Health.HEALTHY
        gpus.append(
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "memoryMiB": g.memory_total // MIB,
                "minor": g.minor,
                "pciBusId": g.pci_bus_id,
                "numaNode": g.numa_node,
                "computeCapability": f"{g.compute_capability[0]}.{g.compute_capability[1]}",
                "migEnabled": g.mig_enabled,
                "computeMode": COMPUTE_MODE_NAMES.get(g.compute_mode, str(g.compute_mode)),
                "lost": g.lost,
                "health": str((health or {}).get(g.uuid, default_health)),
                "mode": str(p.mode) if p else None,
                "api": str(p.api) if p else None,
                "resource": p.resource if p else None,
                "slices": len(p.device_ids) if p else None,
                "sliceSizeMiB": p.slice_size // MIB if p else None,
                "reservedMiB": p.reserved // MIB if p else None,
                "enforcement": [str(e) for e in p.enforcement] if p else None,
                "skipped": p.skipped if p else None,
            }
        )
    report: dict[str, Any] = {
        "node": {
            "driverVersion": node.driver_version,
            "cudaDriverVersion": _cuda(node.cuda_driver_version),
            "cudaMemoryLimits": node.cuda_memory_limits,
            "cgroupV2": node.cgroup_v2,
            "nvidiaCtk": node.nvidia_ctk_present,
            "memoryLimitsHook": node.memory_limits_hook,
            "cudaMemoryLimitsUnmet": list(cuda_limits_unmet),
        },
        "gpus": gpus,
    }
    if dra is not None:
        report["dra"] = dict(dra)
    return report


_COLUMNS = ("GPU", "UUID", "NAME", "MEMORY", "MODE", "SLICES", "ENFORCEMENT", "HEALTH")


def _row(gpu: Mapping[str, Any]) -> list[str]:
    def dash(value: Any) -> str:
        return "-" if value is None else str(value)

    enforcement = gpu["enforcement"]
    slices = dash(gpu["slices"])
    if gpu["skipped"]:
        slices = f"0 ({gpu['skipped']})"
    return [
        str(gpu["index"]),
        gpu["uuid"],
        gpu["name"],
        f"{gpu['memoryMiB'] / 1024:.1f} GiB",
        dash(gpu["mode"]) + (" (dra)" if gpu.get("api") == "dra" else ""),
        slices,
        "-" if enforcement is None else (",".join(enforcement) or "none"),
        gpu["health"] + (" (lost)" if gpu["lost"] else ""),
    ]


def format_inventory_table(report: Mapping[str, Any]) -> str:
    """A fixed-width table of the report's GPUs under one line of node facts."""
    node = report["node"]
    head = (
        f"driver {node['driverVersion']}  CUDA {node['cudaDriverVersion']}  "
        f"cuda-memory-limits={'yes' if node['cudaMemoryLimits'] else 'no'}  "
        f"cgroup={'v2' if node['cgroupV2'] else 'v1'}  "
        f"nvidia-ctk={'yes' if node['nvidiaCtk'] else 'no'}  "
        f"memory-limit-hook={'yes' if node.get('memoryLimitsHook') else 'no'}"
    )
    unmet = node.get("cudaMemoryLimitsUnmet") or []
    if unmet:
        head += "\ncuda-memory-limits unavailable: " + "; ".join(unmet)
    rows = [list(_COLUMNS)] + [_row(g) for g in report["gpus"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    dra = report.get("dra")
    if dra is not None:
        lines.append(_dra_line(dra))
    return "\n".join([head, *lines])


def _dra_line(dra: Mapping[str, Any]) -> str:
    gpus = ",".join(str(i) for i in dra.get("gpus") or []) or "none"
    if dra.get("served") is False:
        return f"DRA (GPUs {gpus}): not served: {dra.get('reason') or 'unknown'}"
    if dra.get("served") is None:
        return f"DRA (GPUs {gpus}): served by the running plugin (--state-dir shows its state)"
    sl = dra.get("slices") or {}
    line = (
        f"DRA (GPUs {gpus}): registered={'yes' if dra.get('registered') else 'no'} "
        f"slices={sl.get('slices', 0)} generation={sl.get('generation', 0)} "
        f"consumable-capacity={'yes' if sl.get('consumableCapacity', True) else 'no'}"
    )
    if sl.get("droppedFields"):
        line += f" dropped: {', '.join(sl['droppedFields'][:4])}"
    return line
