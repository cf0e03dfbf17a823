"""`api` and `gpus[].api`: each GPU is handed out by exactly one front-end (DESIGN section 10).

The device-plugin side (resources, feed, Allocate, preferred allocation) never sees a DRA GPU;
the DRA side (`SlicePlan.dra_gpus`) never sees a device-plugin GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deviceplugin.config.settings import ConfigError, parse
from deviceplugin.dpapi.allocator import AllocationError
from deviceplugin.dpapi.feed import DeviceFeed
from deviceplugin.dpapi.preferred import preferred
from deviceplugin.health.board import HealthBoard
from deviceplugin.model import Mode, ServingApi
from deviceplugin.plan import build_plan, merge_reload
from tests.test_allocator import TS, Rig
from tests.test_plan import inventory

GPU1_ON_DRA = {"gpus": [{"match": {"index": 1}, "mode": "time-slicing", "api": "dra"}]}


def test_default_is_the_device_plugin_api() -> None:
    config = parse({"version": "v1"})
    assert config.api is ServingApi.DEVICE_PLUGIN
    plan = build_plan(inventory("h200x2"), config)
    assert all(gp.api is ServingApi.DEVICE_PLUGIN and gp.device_plugin for gp in plan.gpus)
    assert plan.dra_gpus == ()


def test_top_level_and_per_gpu_api() -> None:
    config = parse(
        {
            "version": "v1",
            "api": "dra",
            "gpus": [{"match": {"index": 0}, "mode": "exclusive", "api": "device-plugin"}],
        }
    )
    plan = build_plan(inventory("h200x2"), config)
    assert [gp.api for gp in plan.gpus] == [ServingApi.DEVICE_PLUGIN, ServingApi.DRA]
    assert [gp.gpu.index for gp in plan.dra_gpus] == [1]
    assert plan.resources == ("nvidia.com/gpu",)


def test_bad_api_values_are_named_by_path() -> None:
    with pytest.raises(ConfigError) as err:
        bad_rule = {"match": {"index": 0}, "mode": "exclusive", "api": 3}
        parse({"version": "v1", "api": "csi", "gpus": [bad_rule]})
    assert any(p.startswith("api: must be one of device-plugin, dra") for p in err.value.problems)
    assert any(p.startswith("gpus[0].api: must be one of") for p in err.value.problems)


def test_device_plugin_side_never_sees_a_dra_gpu() -> None:
    plan = build_plan(inventory("h200x2"), parse({"version": "v1", **GPU1_ON_DRA}))
    gpu0, gpu1 = plan.gpus
    assert gpu0.device_plugin and not gpu0.dra
    assert gpu1.dra and not gpu1.device_plugin and gpu1.advertised
    assert plan.for_resource(gpu1.resource) == (gpu0,)
    feed = DeviceFeed(lambda: plan, HealthBoard(), lambda _r: set())
    listed = feed.encoded(gpu0.resource)
    assert gpu0.uuid.encode() in listed and gpu1.uuid.encode() not in listed
    available = list(gpu0.device_ids + gpu1.device_ids)
    assert all(d.startswith(gpu0.uuid) for d in preferred(plan, gpu0.resource, available, [], 3))


def test_allocate_refuses_a_dra_gpus_slices(tmp_path: Path) -> None:
    rule = {"match": {"index": 0}, "mode": "time-slicing", "api": "dra"}
    rig = Rig(tmp_path, cfg={"gpus": [rule]})
    with pytest.raises(AllocationError, match="unknown device IDs"):
        rig.allocator.allocate(TS, rig.ids(0, 0))
    assert rig.ledger.records() == []


def test_moving_a_gpu_between_apis_waits_while_it_is_allocated() -> None:
    inv = inventory("h200x2")
    old = build_plan(inv, parse({"version": "v1"}))
    new = build_plan(inv, parse({"version": "v1", **GPU1_ON_DRA}))
    merged, held = merge_reload(old, new, [inv.gpus[1].uuid])
    assert held == [inv.gpus[1].uuid]
    assert merged.gpus[1].api is ServingApi.DEVICE_PLUGIN
    merged, held = merge_reload(old, new, [])
    assert held == [] and merged.gpus[1].api is ServingApi.DRA
    assert merged.gpus[1].mode is Mode.TIME_SLICING
