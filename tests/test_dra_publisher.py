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
from deviceplugin.model import GIB, Mode, ServingApi
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
    agent = fake.agent_token()  # the agent may create slices; the schema refuses this one
    request = urllib.request.Request(
        f"{fake.url}/apis/resource.k8s.io/v1/resourceslices",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {agent}"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 422
    assert fake.dra.slices_of(NODE) == []


def test_a_one_slice_gpu_is_published_beside_the_others(api: Api, fake: FakeApiServer) -> None:
    # an 80 GB GPU with sliceSize 40Gi: its old shape made the API server refuse the slice,
    # so the node's every DRA GPU went unpublished, retried for ever
    big = replace(gpu_plan(1, Mode.TIME_SLICING), api=ServingApi.DRA, usable=79 * GIB,
                  slice_size=40 * GIB)  # fmt: skip
    plan = SlicePlan((replace(gpu_plan(0, Mode.TIME_SLICING), api=ServingApi.DRA), big), ())
    pub = SlicePublisher(api, NODE, lambda: plan, "615.43.02", settings=FAST)
    pub.reconcile()
    (slc,) = fake.dra.slices_of(NODE)
    assert [d["name"] for d in slc["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert pub.status.published and pub.status.refused == ()


def test_a_refused_device_is_named_and_the_others_are_published(
    api: Api, fake: FakeApiServer
) -> None:
    plan = dra_plan(Mode.TIME_SLICING, Mode.TIME_SLICING, Mode.EXCLUSIVE)
    bad = {"gpu-1": [{"key": "gpu-fraction.dev/unhealthy", "value": "not a label value!",
                      "effect": "NoSchedule"}]}  # fmt: skip
    refused: list[tuple[str, str]] = []
    pub = SlicePublisher(api, NODE, lambda: plan, "615.43.02", settings=FAST, taints=lambda: bad,
                         on_refused=lambda d, m: refused.append((d, m)))  # fmt: skip
    pub.start()
    try:
        wait_until(lambda: pub.status.published)
        (slc,) = fake.dra.slices_of(NODE)
        assert [d["name"] for d in slc["spec"]["devices"]] == ["gpu-0", "gpu-2"]
        ((device, why),) = pub.status.refused
        assert device == "gpu-1" and "spec.devices[1].taints[0].value" in why
        ((named, message),) = refused  # told once, with its GPU
        assert named == f"gpu-1 ({plan.dra_gpus[1].uuid})" and "not a label value" in message
        assert pub.status.as_dict()["refused"] == {"gpu-1": why}
        pub.plan_changed()  # a new plan may have fixed it: tried again, refused again
        wait_until(lambda: len(refused) == 2 and pub.status.refused)
        (slc,) = fake.dra.slices_of(NODE)
        assert [d["name"] for d in slc["spec"]["devices"]] == ["gpu-0", "gpu-2"]
    finally:
        pub.stop()


def test_an_unjudged_device_waits_when_the_pool_holds_nothing_and_keeps_what_it_holds(
    api: Api, fake: FakeApiServer
) -> None:
    plan = dra_plan(Mode.TIME_SLICING, Mode.SM_SHARING)
    pending = {"gpu-1"}
    starting = {"key": "gpu-fraction.dev/unhealthy", "value": "mps-down", "effect": "NoExecute",
                "timeAdded": "2026-01-01T00:00:00Z"}  # fmt: skip
    taints = {"gpu-1": [starting]}
    pub = SlicePublisher(api, NODE, lambda: plan, "615.43.02", settings=FAST,
                         taints=lambda: taints, pending=lambda: pending)  # fmt: skip
    pub.reconcile()  # first start: nothing held, the device waits
    (slc,) = fake.dra.slices_of(NODE)
    assert [d["name"] for d in slc["spec"]["devices"]] == ["gpu-0"]
    assert pub.status.waiting == ("gpu-1",)
    pending.clear()  # judged healthy
    taints.clear()
    pub.reconcile()
    (slc,) = fake.dra.slices_of(NODE)
    assert [(d["name"], d.get("taints")) for d in slc["spec"]["devices"]] == [
        ("gpu-0", None), ("gpu-1", None)]  # fmt: skip
    # a restart: a new publisher, the daemon not yet judged again, the pool holds gpu-1 clean
    pending.add("gpu-1")
    taints["gpu-1"] = [starting]
    again = SlicePublisher(api, NODE, lambda: plan, "615.43.02", settings=FAST,
                           taints=lambda: taints, pending=lambda: pending)  # fmt: skip
    writes = len(fake.dra.history)
    again.reconcile()
    assert len(fake.dra.history) == writes  # nothing to write: it keeps what was published
    assert again.status.published and again.status.waiting == ()
    pending.clear()  # judged down after all: now the taint is earned
    again.reconcile()
    (slc,) = fake.dra.slices_of(NODE)
    assert slc["spec"]["devices"][1]["taints"][0]["value"] == "mps-down"


def test_dropped_fields_paths() -> None:
    sent = {"devices": [{"name": "gpu-0", "a": 1, "c": {"x": {"p": 1, "v": 2}}}]}
    got = {"devices": [{"name": "gpu-0", "c": {"x": {"v": 2}}}]}
    assert dropped_fields(sent, got) == ["devices[gpu-0].a", "devices[gpu-0].c.x.p"]
    assert dropped_fields(sent, sent) == []
