"""A stand-in for the scheduler's DRA allocator, enough for the demo and the benchmarks.

A claim's `exactly` requests name one of our DeviceClasses (one per mode) and optionally an
amount of `memory`; each is given a device of this driver's published slices that has the
mode, carries no NoSchedule/NoExecute taint and still has room, as the real allocator does
with consumable capacity (KEP-5075): the amount is rounded up to the request policy's step
(the policy's `default` when none is named), a multi-allocatable device gets a fresh
`shareID`, a device that is not multi-allocatable goes whole to one claim. `count` repeats
a request; `distinctAttribute` keeps its devices apart. Config travels as `FromClaim`.
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


def _used(claims: Iterable[Obj], driver: str) -> dict[tuple[str, str], list[int]]:
    """(pool, device) -> the memory each allocated result consumes (0: a whole device)."""
    used: dict[tuple[str, str], list[int]] = {}
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for r in (allocation.get("devices") or {}).get("results") or []:
            if r.get("driver") != driver or r.get("adminAccess"):
                continue
            memory = (r.get("consumedCapacity") or {}).get("memory")
            used.setdefault((r["pool"], r["device"]), []).append(
                parse_quantity(memory) if memory else 0
            )
    return used


def _amount(device: Obj, asked: str | None) -> int | None:
    """What a share of `device` consumes for `asked`; None: the device does not fit it."""
    memory = (device.get("capacity") or {}).get("memory") or {}
    policy = memory.get("requestPolicy") or {}
    want = parse_quantity(asked) if asked else parse_quantity(policy.get("default", "0"))
    valid = policy.get("validRange")
    if valid:
        low, step = parse_quantity(valid["min"]), parse_quantity(valid["step"])
        want = low + max(0, math.ceil((want - low) / step)) * step
        if want > parse_quantity(valid["max"]):
            return None
    return want


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
        asked = ((exactly.get("capacity") or {}).get("requests") or {}).get("memory")
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
                total = parse_quantity(device["capacity"]["memory"]["value"])
                if not device.get("allowMultipleAllocations"):
                    if key in used:
                        why.append(f"{device['name']} is taken whole")
                        continue
                    result: Obj = {}
                    used[key] = [total]
                else:
                    amount = _amount(device, asked)
                    if amount is None or sum(used.get(key, [])) + amount > total:
                        left = total - sum(used.get(key, []))
                        why.append(f"{device['name']} has {format_quantity(left)} left")
                        continue
                    result = {
                        "consumedCapacity": {"memory": format_quantity(amount)},
                        "shareID": str(uuid.uuid4()),
                    }
                    used.setdefault(key, []).append(amount)
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
