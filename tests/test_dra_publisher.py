"""SlicePublisher against the in-test API server over real HTTP.

Slices: published with the Node as owner, republished at a higher generation after a wipe
and after a plan change, left alone when unchanged; dropped consumable-capacity fields are
detected by reading back and fractional GPUs then published without multi-allocation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from deviceplugin.dra import slices
from deviceplugin.dra.publisher import Settings, SlicePublisher, dropped_fields
from deviceplugin.kube.client import Api
from deviceplugin.model import Mode, ServingApi
from deviceplugin.plan import SlicePlan
from deviceplugin.simulate.apiserver import FakeApiServer
from tests.planfixtures import gpu_plan

NODE = "node-1"
FAST = Settings(resync=60.0, retry_first=0.05, retry_cap=0.5)


def wait_until(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def dra_plan(*modes: Mode) -> SlicePlan:
    return SlicePlan(tuple(replace(gpu_plan(i, m), api=ServingApi.DRA)
                           for i, m in enumerate(modes)), ())  # fmt: skip


class Holder:
    def __init__(self, plan: SlicePlan) -> None:
        self.plan = plan

    def __call__(self) -> SlicePlan:
        return self.plan


@pytest.fixture
def publisher(api: Api) -> Iterator[tuple[SlicePublisher, Holder, list[list[str]]]]:
    holder = Holder(dra_plan(Mode.TIME_SLICING, Mode.EXCLUSIVE))
    dropped: list[list[str]] = []
    pub = SlicePublisher(api, NODE, holder, "615.43.02", on_dropped=dropped.append,
                         settings=FAST)  # fmt: skip
    pub.start()
    yield pub, holder, dropped
    pub.stop()


def generations(fake: FakeApiServer) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in fake.dra.slices_of(NODE)}


def test_publishes_with_owner_and_republishes_after_a_wipe(
    fake: FakeApiServer, publisher: tuple[SlicePublisher, Holder, list[list[str]]]
) -> None:
    pub, _, _ = publisher
    (slc,) = wait_until(lambda: fake.dra.slices_of(NODE))
    assert slc["metadata"]["ownerReferences"][0]["uid"] == "uid-node-node-1"
    assert [d["name"] for d in slc["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    first = slc["spec"]["pool"]["generation"]
    wait_until(lambda: pub.status.published)
    assert fake.dra.wipe_slices(NODE, slices.DRIVER) == 1
    (again,) = wait_until(lambda: fake.dra.slices_of(NODE))
    assert again["spec"]["pool"]["generation"] > first


def test_unchanged_plan_writes_nothing(
    fake: FakeApiServer, publisher: tuple[SlicePublisher, Holder, list[list[str]]]
) -> None:
    pub, _, _ = publisher
    wait_until(lambda: pub.status.published)
    writes, passes = pub.status.writes, pub.reconciles
    pub.republish()
    wait_until(lambda: pub.reconciles > passes)
    assert pub.status.writes == writes
    assert pub.status.published


def test_plan_change_raises_the_generation_of_every_slice(
    fake: FakeApiServer, publisher: tuple[SlicePublisher, Holder, list[list[str]]]
) -> None:
    pub, holder, _ = publisher
    wait_until(lambda: pub.status.published)
    (before,) = generations(fake)
    holder.plan = dra_plan(Mode.SM_SHARING, Mode.EXCLUSIVE, Mode.TIME_SLICING)
    pub.plan_changed()
    wait_until(lambda: generations(fake) == {before + 1})
    (slc,) = fake.dra.slices_of(NODE)
    assert slc["spec"]["devices"][0]["attributes"]["mode"] == {"string": "sm-sharing"}
    assert len(slc["spec"]["devices"]) == 3


def test_many_gpus_span_slices_with_the_right_count(api: Api, fake: FakeApiServer) -> None:
    plan = dra_plan(*([Mode.TIME_SLICING] * 130))
    plan = SlicePlan(tuple(replace(gp, gpu=replace(gp.gpu, index=i)) for i, gp in
                           enumerate(plan.gpus)), ())  # fmt: skip
    pub = SlicePublisher(api, NODE, lambda: plan, "615.43.02", settings=FAST)
    pub.reconcile()
    listed = fake.dra.slices_of(NODE)
    assert [len(s["spec"]["devices"]) for s in listed] == [128, 2]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in listed} == {2}
    # fewer GPUs: the extra slice goes, the rest is at a new generation
    plan = SlicePlan(plan.gpus[:3], ())
    pub.reconcile()
    (only,) = fake.dra.slices_of(NODE)
    assert only["spec"]["pool"] == {"name": NODE, "generation": 2, "resourceSliceCount": 1}


def test_dropped_consumable_capacity_is_detected_and_fallen_back_from(
    fake: FakeApiServer, api: Api
) -> None:
    fake.dra.drop_consumable = True
    dropped: list[list[str]] = []
    plan = dra_plan(Mode.TIME_SLICING, Mode.EXCLUSIVE)
    pub = SlicePublisher(api, NODE, lambda: plan, "615.43.02", on_dropped=dropped.append,
                         settings=FAST)  # fmt: skip
    pub.reconcile()
    assert dropped and any("gpu-0].allowMultipleAllocations" in p for p in dropped[0])
    assert any("requestPolicy" in p for p in dropped[0])
    assert pub.status.dropped and not pub.status.multi_allocation
    pub.reconcile()  # the fallback: one whole device per fractional GPU, nothing dropped
    (slc,) = fake.dra.slices_of(NODE)
    gpu0 = slc["spec"]["devices"][0]
    assert "allowMultipleAllocations" not in gpu0
    assert gpu0["capacity"] == {"memory": {"value": "7Gi"}}
    assert pub.status.published and len(dropped) == 1


def test_the_fake_refuses_a_policy_off_the_grid(fake: FakeApiServer, api: Api) -> None:
    plan = dra_plan(Mode.TIME_SLICING)
    (body,) = slices.build(plan, owner=slices.Owner(NODE, "u"), generation=1,
                           driver_version="615.43.02")  # fmt: skip
    policy = body["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]
    policy["validRange"]["max"] = "7680Mi"  # not min + n * 1Gi
    from deviceplugin.kube.client import KubeError

    with pytest.raises(KubeError) as err:
        api.create_resource_slice(body)
    assert err.value.status == 422


def test_the_fake_refuses_a_slice_the_schema_refuses(fake: FakeApiServer) -> None:
    # (The kubernetes client refuses unknown fields itself, so this goes around it.)
    import json
    import urllib.error
    import urllib.request

    (body,) = slices.build(dra_plan(Mode.TIME_SLICING), owner=slices.Owner(NODE, "u"),
                           generation=1, driver_version="615.43.02")  # fmt: skip
    body["spec"]["devices"][0]["attributes"]["index"] = {"integer": 0}  # not a v1 field
    request = urllib.request.Request(
        f"{fake.url}/apis/resource.k8s.io/v1/resourceslices",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 422
    assert fake.dra.slices_of(NODE) == []


def test_dropped_fields_paths() -> None:
    sent = {"devices": [{"name": "gpu-0", "a": 1, "c": {"x": {"p": 1, "v": 2}}}]}
    got = {"devices": [{"name": "gpu-0", "c": {"x": {"v": 2}}}]}
    assert dropped_fields(sent, got) == ["devices[gpu-0].a", "devices[gpu-0].c.x.p"]
    assert dropped_fields(sent, sent) == []
