"""A stand-in for the scheduler's DRA allocator, enough for the demo and the benchmarks.

A claim's `exactly` requests name one of our DeviceClasses (one per mode) and optionally an
amount of `memory`; each is given a device of this driver's published slices that has the
mode, carries no NoSchedule/NoExecute taint and still has room, as the real allocator does
with consumable capacity (KEP-5075): every capacity of a multi-allocatable device is
consumed, as the real allocator's `CmpRequestOverCapacity` and `calculateConsumedCapacity`
(k8s.io/dynamic-resource-allocation, structured allocator) do it: the amount asked rounded
up to the request policy's range (the policy's `default` when none is named, the whole value
without a policy), refused past the range's `max`, and summed with what earlier claims hold
against the value (`memory`, and `mpsClients` on sm-sharing GPUs). A multi-allocatable
device gets a fresh `shareID`, a device that is not multi-allocatable goes whole to one
claim. `count` repeats a request; `distinctAttribute` keeps its devices apart. Config
travels as `FromClaim`.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable
from typing import Any

from deviceplugin.quantity import format_quantity, parse_quantity

Obj = dict[str, Any]
CLASS_SUFFIX = ".gpu-fraction.dev"  # DeviceClass `<mode>.gpu-fraction.dev` selects by mode
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


class Unschedulable(Exception):
    """No device of this node fits the claim; the message says why, as the scheduler would."""


def current_devices(slices: Iterable[Obj], driver: str) -> list[Obj]:
    """The devices of each pool's newest generation (older slices are being replaced)."""
    newest: dict[str, int] = {}
    mine = [s for s in slices if s["spec"]["driver"] == driver]
    for s in mine:
        pool = s["spec"]["pool"]
        newest[pool["name"]] = max(newest.get(pool["name"], 0), int(pool["generation"]))
    return [
        dict(d, _pool=s["spec"]["pool"]["name"])
        for s in mine
        if int(s["spec"]["pool"]["generation"]) == newest[s["spec"]["pool"]["name"]]
        for d in s["spec"].get("devices") or []
    ]


Used = dict[tuple[str, str], list[dict[str, int]]]


def _used(claims: Iterable[Obj], driver: str) -> Used:
    """(pool, device) -> what each allocated result consumes, per capacity ({}: whole)."""
    used: Used = {}
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for r in (allocation.get("devices") or {}).get("results") or []:
            if r.get("driver") != driver or r.get("adminAccess"):
                continue
            consumed = r.get("consumedCapacity") or {}
            used.setdefault((r["pool"], r["device"]), []).append(
                {name: parse_quantity(q) for name, q in consumed.items()}
            )
    return used


def _consumed(cap: Obj, asked: str | None) -> int | None:
    """What one share consumes of a capacity for `asked`; None: the policy refuses it."""
    policy = cap.get("requestPolicy")
    if asked is None:  # fillEmptyRequest: the default, or the whole value without one
        return parse_quantity((policy or {}).get("default", cap["value"]))
    want = parse_quantity(asked)
    valid = (policy or {}).get("validRange")
    if valid:
        low = parse_quantity(valid["min"])
        step = parse_quantity(valid["step"]) if "step" in valid else None
        if want < low:
            want = low
        elif step:
            want = low + math.ceil((want - low) / step) * step
        if "max" in valid and want > parse_quantity(valid["max"]):
            return None
    return want


def _share(device: Obj, asked: dict[str, str], held: list[dict[str, int]]) -> Obj | str:
    """The consumed capacity of a new share of `device`, or why it does not fit."""
    capacity = device.get("capacity") or {}
    unknown = sorted(set(asked) - set(capacity))
    if unknown:
        return f"{device['name']} has no capacity {','.join(unknown)}"
    out: Obj = {}
    for name, cap in sorted(capacity.items()):
        amount = _consumed(cap, asked.get(name))
        total = parse_quantity(cap["value"])
        left = total - sum(h.get(name, 0) for h in held)
        if amount is None or amount > left:
            return f"{device['name']} has {format_quantity(left)} {name} left"
        out[name] = format_quantity(amount)
    return out


def _blocked(device: Obj) -> str | None:
    for taint in device.get("taints") or []:
        if taint.get("effect") in BLOCKING_EFFECTS:
            return f"{taint['key']}={taint.get('value', '')}:{taint['effect']}"
    return None


def allocate(claim: Obj, slices: Iterable[Obj], allocated: Iterable[Obj], driver: str) -> Obj:
    """`status.allocation` for `claim` (a ResourceClaim body) on the node of `slices`, given the
    claims already `allocated`; raises Unschedulable with the reason."""
    devices = current_devices(slices, driver)
    used = _used(allocated, driver)
    spec = claim["spec"]["devices"]
    distinct = {
        r
        for c in spec.get("constraints") or []
        if c.get("distinctAttribute")
        for r in c["requests"]
    }
    results: list[Obj] = []
    node = None
    for request in spec.get("requests") or []:
        exactly = request["exactly"]
        mode = exactly["deviceClassName"].removesuffix(CLASS_SUFFIX)
        asked = dict((exactly.get("capacity") or {}).get("requests") or {})
        taken: set[str] = set()
        for _ in range(int(exactly.get("count", 1))):
            why = [f"no {exactly['deviceClassName']} device of this node fits"]
            for device in devices:
                key = (device["_pool"], device["name"])
                if device["attributes"].get("mode", {}).get("string") != mode:
                    continue
                if request["name"] in distinct and device["name"] in taken:
                    continue
                blocked = _blocked(device)
                if blocked:
                    why.append(f"{device['name']} tainted {blocked}")
                    continue
                if not device.get("allowMultipleAllocations"):
                    if key in used:
                        why.append(f"{device['name']} is taken whole")
                        continue
                    result: Obj = {}
                    used[key] = [{}]
                else:
                    share = _share(device, asked, used.get(key, []))
                    if isinstance(share, str):
                        why.append(share)
                        continue
                    result = {"consumedCapacity": share, "shareID": str(uuid.uuid4())}
                    used.setdefault(key, []).append(
                        {n: parse_quantity(q) for n, q in share.items()}
                    )
                taken.add(device["name"])
                node = device["_pool"]
                results.append(
                    {
                        "request": request["name"],
                        "driver": driver,
                        "pool": device["_pool"],
                        "device": device["name"],
                        **result,
                    }
                )
                break
            else:
                raise Unschedulable("; ".join(why))
    config = [
        {"source": "FromClaim", "requests": c.get("requests", []), "opaque": c["opaque"]}
        for c in spec.get("config") or []
        if "opaque" in c
    ]
    selector = {"key": "metadata.name", "operator": "In", "values": [node]}
    return {
        "devices": {"results": results, "config": config},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [selector]}]},
    }
