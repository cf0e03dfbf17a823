"""Pure builders of what the plugin writes: node patch, plan entries, allocation records."""

from __future__ import annotations

import json
from dataclasses import replace

from deviceplugin.dpapi import kube_records as rec
from deviceplugin.ledger.record import AllocationRecord
from deviceplugin.model import GIB, MIB, Delivery, Enforcement, GpuUuid, Mode, SliceId
from deviceplugin.plan import SlicePlan, serving_none_message
from deviceplugin.quantity import format_quantity
from tests.planfixtures import gpu_plan


def test_slice_size_label_only_when_all_fractional_gpus_agree() -> None:
    same = SlicePlan(
        gpus=(
            gpu_plan(0, Mode.TIME_SLICING),
            gpu_plan(1, Mode.SM_SHARING),
            gpu_plan(2, Mode.EXCLUSIVE),
        ),
        resources=(),
    )
    labels = rec.node_patch(same, {}, set())["metadata"]["labels"]
    assert labels[rec.SLICE_SIZE_LABEL] == "1Gi"
    mixed = SlicePlan(
        gpus=(
            gpu_plan(0, Mode.TIME_SLICING),
            replace(gpu_plan(1, Mode.SM_SHARING), slice_size=512 * MIB),
        ),
        resources=(),
    )
    labels = rec.node_patch(mixed, {}, set())["metadata"]["labels"]
    assert labels[rec.SLICE_SIZE_LABEL] is None
    assert labels["gpu-fraction.dev/mode.exclusive"] is None


def test_skipped_gpu_sets_no_mode_label_but_is_in_the_plan() -> None:
    skipped = replace(gpu_plan(0, Mode.SM_SHARING), skipped="MIG enabled")
    plan = SlicePlan(gpus=(gpu_plan(1, Mode.TIME_SLICING), skipped), resources=())
    patch = rec.node_patch(plan, {}, set())
    assert patch["metadata"]["labels"]["gpu-fraction.dev/mode.sm-sharing"] is None
    entries = json.loads(patch["metadata"]["annotations"][rec.PLAN_KEY])
    assert entries[1]["skipped"] == "MIG enabled"
    assert entries[0]["largestFreeBlock"] == format_quantity(4 * GIB)


def test_serving_label_is_none_only_while_nothing_is_advertised() -> None:
    serving = SlicePlan(gpus=(gpu_plan(0, Mode.TIME_SLICING),), resources=())
    assert rec.node_patch(serving, {}, set())["metadata"]["labels"][rec.SERVING_LABEL] is None
    assert serving_none_message(serving) is None
    why = "enforcement required but cuda-memory-limits unavailable: driver 580.95.05 ..."
    idle = SlicePlan(
        gpus=tuple(replace(gpu_plan(i, Mode.TIME_SLICING), skipped=why) for i in range(2)),
        resources=(),
    )
    assert rec.node_patch(idle, {}, set())["metadata"]["labels"][rec.SERVING_LABEL] == "none"
    message = serving_none_message(idle)
    assert message is not None and f"GPU 0,1: {why}" in message and "r580" in message
    empty = serving_none_message(SlicePlan(gpus=(), resources=()))
    assert empty is not None and "no GPU" in empty


def _record(ids: tuple[str, ...], resource: str, mode: Mode) -> AllocationRecord:
    return AllocationRecord(
        device_ids=tuple(SliceId(i) for i in ids),
        resource=resource,
        gpus=tuple(GpuUuid(i.split("::")[0]) for i in ids[:1]),
        mode=mode,
        request_mib=1024,
        limit_mib=1024,
        enforcement=(Enforcement.MPS_PINNED_LIMIT,),
        delivery=Delivery.ENV,
        ceiling_source="no-candidates",
        ceiling_policy=None,
        cdi_spec=None,
        created=0.0,
    )


def test_allocations_value_keyed_by_container() -> None:
    init = _record(("GPU-a::0",), "r", Mode.SM_SHARING)
    app = _record(("GPU-a::0",), "r", Mode.SM_SHARING)
    value = json.loads(rec.allocations_value(rec.by_container([("init", init), ("app", app)])))
    assert set(value) == {"init", "app"}
    assert value["app"]["enforcement"] == ["mps-pinned-limit"]
    assert value["app"]["delivery"] == "plain-env"
    assert value["app"]["ceilingSource"] == "no-candidates"
    assert rec.recorded_containers({rec.ALLOCATIONS_KEY: json.dumps(value)}) == {"init", "app"}
    assert rec.recorded_containers({rec.ALLOCATIONS_KEY: "not json"}) == set()
