"""What the plugin writes to the API server, as pure functions of its state.

Pod allocation records (`gpu-fraction.dev/allocations`), node labels and the per-GPU plan
annotation, and Event bodies. Only keys under `gpu-fraction.dev/` are ever written; a key we
own that no longer applies is sent as null, which a merge patch deletes.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from deviceplugin.health.board import Fault, device_health
from deviceplugin.ledger.record import AllocationRecord
from deviceplugin.model import FaultDomain, GpuUuid, Health, Mode, ServingApi
from deviceplugin.plan import SlicePlan
from deviceplugin.quantity import format_quantity

PREFIX = "gpu-fraction.dev/"
ALLOCATIONS_KEY = PREFIX + "allocations"
PLAN_KEY = PREFIX + "plan"
SLICE_SIZE_LABEL = PREFIX + "slice-size"
SERVING_LABEL = PREFIX + "serving"  # `none` while the plan advertises nothing
SERVING_NONE_REASON = "GpuFractionServingNone"
SERVING_AGAIN_REASON = "GpuFractionServing"
COMPONENT = "gpu-fraction-device-plugin"


def mode_label(mode: Mode) -> str:
    return f"{PREFIX}mode.{mode.value}"


def allocation_entry(record: AllocationRecord) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "gpu": record.gpu,
        "mode": record.mode.value,
        "requestMiB": record.request_mib,
        "limitMiB": record.limit_mib,
        "enforcement": [e.value for e in record.enforcement],
        "delivery": record.delivery.value,
        "ceilingSource": record.ceiling_source,
        "ceilingPolicy": record.ceiling_policy,
    }
    if len(record.gpus) > 1:
        entry["gpus"] = list(record.gpus)
    return entry


def allocations_value(by_container: Mapping[str, list[AllocationRecord]]) -> str:
    """The annotation value: container → entry (a list in the rare case of several resources)."""
    body: dict[str, Any] = {}
    for container in sorted(by_container):
        entries = [allocation_entry(r) for r in sorted(by_container[container], key=_rkey)]
        body[container] = entries[0] if len(entries) == 1 else entries
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _rkey(record: AllocationRecord) -> tuple[str, ...]:
    return (record.resource, *record.device_ids)


def recorded_containers(annotations: Mapping[str, str]) -> set[str]:
    """Containers named in a pod's allocations annotation (unparseable → none)."""
    try:
        body = json.loads(annotations.get(ALLOCATIONS_KEY, "{}"))
    except ValueError:
        return set()
    return set(body) if isinstance(body, dict) else set()


def gpu_health(mode: Mode, faults: Mapping[FaultDomain, Fault]) -> Health:
    return device_health(mode, faults.keys(), allocated=True)


def plan_entries(
    plan: SlicePlan,
    faults: Mapping[GpuUuid, Mapping[FaultDomain, Fault]],
    used: Collection[str],
) -> list[dict[str, Any]]:
    out = []
    for gpu in plan.gpus:
        gpu_faults = faults.get(gpu.uuid, {})
        free = sum(1 for d in gpu.device_ids if d not in used)
        # What a new container could get: nothing when its devices are Unhealthy to newcomers.
        open_to_new = device_health(gpu.mode, gpu_faults.keys(), allocated=False)
        largest = free * gpu.slice_size if open_to_new is Health.HEALTHY else 0
        entry: dict[str, Any] = {
            "uuid": gpu.uuid,
            "product": gpu.gpu.name,
            "mode": gpu.mode.value,
            "sliceSize": format_quantity(gpu.slice_size),
            "slices": len(gpu.device_ids),
            "freeSlices": free,
            "largestFreeBlock": format_quantity(largest),
            "enforcement": [e.value for e in gpu.enforcement],
            "health": gpu_health(gpu.mode, gpu_faults).value,
        }
        if gpu_faults:
            entry["faults"] = {d.value: f.cause for d, f in sorted(gpu_faults.items())}
        if gpu.skipped:
            entry["skipped"] = gpu.skipped
        if gpu.api is not ServingApi.DEVICE_PLUGIN:
            entry["api"] = gpu.api.value  # its slices are claims, not extended resources
        out.append(entry)
    return out


def node_patch(
    plan: SlicePlan,
    faults: Mapping[GpuUuid, Mapping[FaultDomain, Fault]],
    used: Collection[str],
) -> dict[str, Any]:
    """Merge patch for the node: our labels (null where they no longer apply) and plan."""
    # The labels steer device-plugin pods (nodeSelector on a mode); DRA claims select devices.
    advertised = [g for g in plan.gpus if g.device_plugin]
    labels: dict[str, str | None] = {
        mode_label(m): "true" if any(g.mode is m for g in advertised) else None for m in Mode
    }
    sizes = {g.slice_size for g in advertised if g.mode is not Mode.EXCLUSIVE}
    labels[SLICE_SIZE_LABEL] = format_quantity(next(iter(sizes))) if len(sizes) == 1 else None
    labels[SERVING_LABEL] = None if advertised else "none"
    value = json.dumps(plan_entries(plan, faults, used), sort_keys=True, separators=(",", ":"))
    return {"metadata": {"labels": labels, "annotations": {PLAN_KEY: value}}}


def event_body(
    involved: Mapping[str, str],
    reason: str,
    message: str,
    warning: bool,
    host: str,
    now: datetime | None = None,
) -> dict[str, Any]:
    """A core/v1 Event about `involved` ({kind, name, namespace?, uid?})."""
    stamp = (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    name = f"{involved['name']}.{secrets.token_hex(8)}"
    obj = {"apiVersion": "v1", **{k: v for k, v in involved.items() if v}}
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": involved.get("namespace") or "default"},
        "involvedObject": obj,
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": COMPONENT, "host": host},
        "reportingComponent": COMPONENT,
        "reportingInstance": host,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def by_container(
    assigned: Iterable[tuple[str, AllocationRecord]],
) -> dict[str, list[AllocationRecord]]:
    out: dict[str, list[AllocationRecord]] = {}
    for container, record in assigned:
        bucket = out.setdefault(container, [])
        if record not in bucket:
            bucket.append(record)
    return out
