"""The scheduler stand-in the demo and benchmarks use: it allocates from the slices the plugin
builds as the real allocator would with consumable capacity (rounding up to the step, room
left, taints, whole devices, distinct devices), and its claims pass the preparer's checks."""

from __future__ import annotations

import re
from typing import Any

import pytest

from deviceplugin.dra import slices
from deviceplugin.dra.results import driver_results
from deviceplugin.model import GIB, MIB, Mode
from deviceplugin.simulate.scheduler import Unschedulable, allocate
from tests.test_dra_slices import build, dra_plan

DRIVER = slices.DRIVER


def claim(cls: str, memory: str | None = None, count: int = 1, distinct: bool = False) -> Any:
    exactly: dict[str, Any] = {"deviceClassName": f"{cls}.gpu-fraction.dev", "count": count}
    if memory:
        exactly["capacity"] = {"requests": {"memory": memory}}
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if distinct:
        devices["constraints"] = [
            {"requests": ["gpu"], "distinctAttribute": "gpu-fraction.dev/uuid"}
        ]
    return {"metadata": {"uid": "u"}, "spec": {"devices": devices}, "status": {}}


def allocated(c: Any, alloc: Any) -> Any:
    return {**c, "status": {"allocation": alloc}}


NODE_SLICES = build(dra_plan(Mode.TIME_SLICING, Mode.SM_SHARING, Mode.EXCLUSIVE))


def test_amounts_round_up_to_the_step_and_the_gpu_fills_up() -> None:
    first = allocate(claim("time-slicing", "1536Mi"), NODE_SLICES, [], DRIVER)
    (r,) = first["devices"]["results"]
    assert (r["device"], r["consumedCapacity"]["memory"]) == ("gpu-0", "2Gi")
    assert r["shareID"]
    held = [allocated(claim("time-slicing"), first)]
    second = allocate(claim("time-slicing", "5Gi"), NODE_SLICES, held, DRIVER)
    assert second["devices"]["results"][0]["shareID"] != r["shareID"]
    held.append(allocated(claim("time-slicing"), second))
    with pytest.raises(Unschedulable, match="gpu-0 has 0 memory left"):  # 7 GiB usable: 2 + 5
        allocate(claim("time-slicing", "1Gi"), NODE_SLICES, held, DRIVER)


def test_no_amount_takes_the_policy_default_and_whole_devices_go_to_one_claim() -> None:
    default = allocate(claim("sm-sharing"), NODE_SLICES, [], DRIVER)
    assert default["devices"]["results"][0]["consumedCapacity"]["memory"] == "7Gi"
    whole = allocate(claim("exclusive"), NODE_SLICES, [], DRIVER)
    (r,) = whole["devices"]["results"]
    assert r["device"] == "gpu-2" and "consumedCapacity" not in r and "shareID" not in r
    with pytest.raises(Unschedulable, match="gpu-2 is taken whole"):
        allocate(claim("exclusive"), NODE_SLICES, [allocated(claim("exclusive"), whole)], DRIVER)


def test_tainted_devices_and_other_modes_are_never_chosen() -> None:
    tainted = build(dra_plan(Mode.TIME_SLICING, Mode.TIME_SLICING))
    dev = tainted[0]["spec"]["devices"][0]
    dev["taints"] = [
        {"key": "gpu-fraction.dev/unhealthy", "value": "xid-79", "effect": "NoSchedule"}
    ]
    out = allocate(claim("time-slicing", "1Gi"), tainted, [], DRIVER)
    assert out["devices"]["results"][0]["device"] == "gpu-1"
    dev["taints"][0]["effect"] = "NoExecute"
    tainted[0]["spec"]["devices"] = [dev]
    with pytest.raises(
        Unschedulable, match=re.escape("gpu-0 tainted gpu-fraction.dev/unhealthy=xid-79")
    ):
        allocate(claim("time-slicing", "1Gi"), tainted, [], DRIVER)
    with pytest.raises(Unschedulable, match=re.escape("no sm-sharing.gpu-fraction.dev device")):
        allocate(claim("sm-sharing", "1Gi"), tainted, [], DRIVER)


def test_count_with_distinct_attribute_spreads_and_the_preparer_accepts_the_results() -> None:
    two = build(dra_plan(Mode.SM_SHARING, Mode.SM_SHARING))
    c = claim("sm-sharing", "1Gi", count=2, distinct=True)
    out = allocate(c, two, [], DRIVER)
    assert [r["device"] for r in out["devices"]["results"]] == ["gpu-0", "gpu-1"]
    same = allocate(claim("sm-sharing", "1Gi", count=2), two, [], DRIVER)
    assert [r["device"] for r in same["devices"]["results"]] == ["gpu-0", "gpu-0"]
    mine = driver_results(allocated(c, out), "u", DRIVER, "node-1")
    assert [r.request for r in mine] == ["gpu", "gpu"]


def test_an_amount_above_the_policy_max_does_not_fit() -> None:
    with pytest.raises(Unschedulable, match="gpu-0 has 7Gi memory left"):
        allocate(claim("time-slicing", f"{8 * GIB // MIB}Mi"), NODE_SLICES, [], DRIVER)


def test_every_consumable_capacity_is_summed_mps_clients_included() -> None:
    # 7 GiB of memory would take 7 claims of 1 GiB; mps.maxClients 2 stops the third
    node = build(dra_plan(Mode.SM_SHARING), max_clients=2)
    held: list[Any] = []
    for _ in range(2):
        out = allocate(claim("sm-sharing", "1Gi"), node, held, DRIVER)
        (r,) = out["devices"]["results"]
        assert r["consumedCapacity"] == {"memory": "1Gi", slices.MPS_CLIENTS: "1"}
        held.append(allocated(claim("sm-sharing"), out))
    with pytest.raises(Unschedulable, match=f"gpu-0 has 0 {slices.MPS_CLIENTS} left"):
        allocate(claim("sm-sharing", "1Gi"), node, held, DRIVER)
    mine = driver_results(held[0], "u", DRIVER, "node-1")  # the preparer reads the memory
    assert [r.consumed_memory for r in mine] == [GIB]


def test_a_one_slice_gpu_rounds_any_amount_up_to_its_single_one() -> None:
    node = build(dra_plan(Mode.TIME_SLICING, usable=79 * GIB, slice_size=40 * GIB))
    out = allocate(claim("time-slicing", "4Gi"), node, [], DRIVER)
    assert out["devices"]["results"][0]["consumedCapacity"] == {"memory": "40Gi"}
    with pytest.raises(Unschedulable, match="gpu-0 has 39Gi memory left"):
        allocate(claim("time-slicing"), node, [allocated(claim("time-slicing"), out)], DRIVER)
