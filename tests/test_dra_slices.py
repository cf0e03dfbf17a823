"""ResourceSlices built from the plan: DESIGN section 10's shape, and valid for the API server.

Every slice the plugin writes is checked here against the Kubernetes 1.36 and 1.37 schemas
(`kubernetes-validate`, strict: unknown fields fail too).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest

from deviceplugin.dra import slices
from deviceplugin.model import GIB, MIB, Mode, ServingApi
from deviceplugin.plan import SlicePlan
from deviceplugin.simulate import dra_apiserver
from tests.planfixtures import gpu_plan

OWNER = slices.Owner("node-1", "uid-node-node-1")
K8S_VERSIONS = ("1.36.0", "1.37.0")


def dra_plan(*modes: Mode, usable: int = 7 * GIB, slice_size: int = GIB) -> SlicePlan:
    gpus = tuple(
        replace(gpu_plan(i, m), api=ServingApi.DRA, usable=usable, slice_size=slice_size)
        if m is not Mode.EXCLUSIVE
        else replace(gpu_plan(i, m), api=ServingApi.DRA, usable=8 * GIB, slice_size=8 * GIB)
        for i, m in enumerate(modes)
    )
    return SlicePlan(gpus, ())


def build(plan: SlicePlan, **kwargs: Any) -> list[dict[str, Any]]:
    return slices.build(plan, owner=OWNER, generation=3, driver_version="615.43.02", **kwargs)


def validate(obj: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        pytest.fail(f"{obj['metadata']['name']} ({version}): {err.message} at {list(err.path)}")


def test_fractional_gpu_is_multi_allocatable_with_a_grid_policy() -> None:
    # 7.5 GiB usable on 1 GiB slices: M = 7 GiB, the top of the min + n*step grid
    (slc,) = build(dra_plan(Mode.SM_SHARING, usable=7 * GIB + 512 * MIB))
    (dev,) = slc["spec"]["devices"]
    assert dev["name"] == "gpu-0"
    assert dev["allowMultipleAllocations"] is True
    memory = dev["capacity"]["memory"]
    assert memory["value"] == "7680Mi"
    assert memory["requestPolicy"] == {
        "default": "7Gi",
        "validRange": {"min": "1Gi", "step": "1Gi", "max": "7Gi"},
    }


def test_exclusive_gpu_is_not_multi_allocatable() -> None:
    (slc,) = build(dra_plan(Mode.EXCLUSIVE))
    (dev,) = slc["spec"]["devices"]
    assert "allowMultipleAllocations" not in dev
    assert dev["capacity"] == {"memory": {"value": "8Gi"}}


def test_without_consumable_capacity_fractional_gpus_are_whole_devices() -> None:
    (slc,) = build(dra_plan(Mode.TIME_SLICING), multi_allocation=False)
    (dev,) = slc["spec"]["devices"]
    assert "allowMultipleAllocations" not in dev
    assert dev["capacity"] == {"memory": {"value": "7Gi"}}


def test_attributes_and_pool() -> None:
    (slc,) = build(dra_plan(Mode.TIME_SLICING, Mode.SM_SHARING))
    spec = slc["spec"]
    assert spec["driver"] == "gpu-fraction.dev"
    assert spec["nodeName"] == "node-1"
    assert spec["pool"] == {"name": "node-1", "generation": 3, "resourceSliceCount": 1}
    owner = slc["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", "node-1", "uid-node-node-1")
    attrs = spec["devices"][1]["attributes"]
    assert attrs["uuid"] == {"string": "GPU-00000001-0000-4000-8000-000000000001"}
    assert attrs["index"] == {"int": 1}
    assert attrs["productName"] == {"string": "NVIDIA H200"}
    assert attrs["mode"] == {"string": "sm-sharing"}
    assert attrs["enforcement"] == {"string": "cuda-memory-limits"}
    assert attrs["driverVersion"] == {"version": "615.43.2"}
    assert attrs["cudaComputeCapability"] == {"version": "9.0.0"}
    assert attrs["numaNode"] == {"int": 1}


def test_only_dra_gpus_are_published() -> None:
    plan = dra_plan(Mode.TIME_SLICING, Mode.SM_SHARING)
    plan = SlicePlan((replace(plan.gpus[0], api=ServingApi.DEVICE_PLUGIN), plan.gpus[1]), ())
    (slc,) = build(plan)
    assert [d["name"] for d in slc["spec"]["devices"]] == ["gpu-1"]


@pytest.mark.parametrize(
    ("text", "version"),
    [("615.43.02", "615.43.2"), ("580.65.06", "580.65.6"), ("570.00", "570.0.0"), ("9", "9.0.0")],
)
def test_driver_version_is_a_semantic_version(text: str, version: str) -> None:
    assert slices.version_attribute(text) == version


def test_at_most_128_devices_per_slice_and_the_count_is_right() -> None:
    many = [{"name": f"gpu-{i}"} for i in range(300)]
    parts = slices.chunks(many)
    assert [len(p) for p in parts] == [128, 128, 44]
    tainted = [dict(d, taints=[{"key": "k", "effect": "NoSchedule"}]) for d in many[:100]]
    assert [len(p) for p in slices.chunks(tainted)] == [64, 36]


def test_an_empty_pool_still_has_one_slice() -> None:
    (slc,) = build(SlicePlan((), ()))
    assert slc["spec"]["devices"] == []
    assert slc["spec"]["pool"]["resourceSliceCount"] == 1


def test_slice_names_are_dns_subdomains_even_for_long_node_names() -> None:
    name = slices.slice_name("n" * 250, 0)
    assert len(name) <= 253
    assert name != slices.slice_name("n" * 249 + "m", 0)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("multi", [True, False])
def test_every_slice_validates_strictly(version: str, multi: bool) -> None:
    plan = dra_plan(Mode.TIME_SLICING, Mode.SM_SHARING, Mode.EXCLUSIVE, usable=7 * GIB + 3 * MIB)
    for slc in build(plan, multi_allocation=multi) + build(SlicePlan((), ())):
        validate(slc, version)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_readme_dra_claims_validate(version: str) -> None:
    import re
    from pathlib import Path

    import yaml

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("### DRA:", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    docs = [d for d in yaml.safe_load_all(block) if d]
    modes = {d["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"]
             for d in docs}  # fmt: skip
    assert modes == {f"{m}.gpu-fraction.dev" for m in ("time-slicing", "sm-sharing", "exclusive")}
    for doc in docs:
        validate(doc, version)


# ---- a GPU that holds one slice only (issue 30, item 2) --------------------------------------
def test_a_one_slice_gpu_gets_a_single_amount_without_a_step() -> None:
    # 79 GiB usable on 40 GiB slices (an 80 GB GPU): min + step = 80 GiB > value, refused by
    # the API server for the whole slice; the same single amount is published without a step
    (slc,) = build(dra_plan(Mode.TIME_SLICING, usable=79 * GIB, slice_size=40 * GIB))
    (dev,) = slc["spec"]["devices"]
    assert dev["capacity"]["memory"] == {
        "value": "79Gi",
        "requestPolicy": {"default": "40Gi", "validRange": {"min": "40Gi", "max": "40Gi"}},
    }
    dra_apiserver.validate_slice(slc)
    for version in K8S_VERSIONS:
        validate(slc, version)


def test_the_stand_in_api_server_refuses_a_step_past_the_value_naming_the_device() -> None:
    (slc,) = build(dra_plan(Mode.TIME_SLICING, Mode.TIME_SLICING, usable=79 * GIB,
                            slice_size=40 * GIB))  # fmt: skip
    policy = slc["spec"]["devices"][1]["capacity"]["memory"]["requestPolicy"]
    policy["validRange"] = {"min": "40Gi", "step": "40Gi", "max": "40Gi"}  # the old shape
    with pytest.raises(dra_apiserver.Invalid, match=r"spec\.devices\[1\].*one step 80Gi is "
                       r"larger than capacity value: 79Gi"):  # fmt: skip
        dra_apiserver.validate_slice(slc)


def test_two_slices_keep_their_step() -> None:
    (slc,) = build(dra_plan(Mode.TIME_SLICING, usable=80 * GIB, slice_size=40 * GIB))
    policy = slc["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]
    assert policy["validRange"] == {"min": "40Gi", "step": "40Gi", "max": "80Gi"}
    dra_apiserver.validate_slice(slc)


# ---- mps.maxClients as a consumable capacity (issue 30, item 5) -----------------------------
def test_sm_sharing_devices_publish_their_client_slots() -> None:
    (slc,) = build(dra_plan(Mode.TIME_SLICING, Mode.SM_SHARING), max_clients=3)
    ts, sm = slc["spec"]["devices"]
    assert slices.MPS_CLIENTS not in ts["capacity"]  # time-slicing needs no MPS client
    assert sm["capacity"][slices.MPS_CLIENTS] == {
        "value": "3",
        "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "1"}},
    }
    dra_apiserver.validate_slice(slc)
    for version in K8S_VERSIONS:
        validate(slc, version)
    (whole,) = build(dra_plan(Mode.SM_SHARING), max_clients=3, multi_allocation=False)
    assert slices.MPS_CLIENTS not in whole["spec"]["devices"][0]["capacity"]  # one claim
