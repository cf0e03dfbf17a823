"""Slice plan tables: presets × modes × slice sizes, enforcement conditions, reload merges.

Inventories are built directly (the plan is pure); the preset shapes mirror the simulator's
`h200x2`, `h200x8`, `a100x4-r580` and `mixed`. Other test modules import `inventory()`.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.config.settings import Config, ConfigError, GpuMatch, GpuRule, load, parse
from deviceplugin.inventory.gpus import Gpu, Inventory, NodeFacts
from deviceplugin.model import (
    GIB,
    MAX_DEVICE_ID_LEN,
    MIB,
    Enforcement,
    GpuUuid,
    Mode,
    split_slice_id,
)
from deviceplugin.plan import build_plan, list_and_watch_size, merge_reload, validate_against

H200 = ("NVIDIA H200", 143771)
A100 = ("NVIDIA A100-SXM4-80GB", 81920)
L4 = ("NVIDIA L4", 23034)

R615 = NodeFacts(
    "615.43.02", 13040, cuda_memory_limits=True, cgroup_v2=True, nvidia_ctk_present=True
)
R580 = NodeFacts(
    "580.95.05", 13000, cuda_memory_limits=False, cgroup_v2=True, nvidia_ctk_present=True
)

PRESETS: dict[str, tuple[list[tuple[str, int]], NodeFacts]] = {
    "h200x2": ([H200] * 2, R615),
    "h200x8": ([H200] * 8, R615),
    "a100x4-r580": ([A100] * 4, R580),
    "mixed": ([H200, H200, L4, L4], R615),
}


def uuid_for(preset: str, i: int) -> GpuUuid:
    return GpuUuid(f"GPU-{zlib.crc32(preset.encode()):08x}-0000-4000-8000-{i:012d}")


def inventory(preset: str = "h200x2", *, numa: bool = True, **node: Any) -> Inventory:
    products, facts = PRESETS[preset]
    half = max(1, len(products) // 2)
    gpus = tuple(
        Gpu(
            index=i,
            uuid=uuid_for(preset, i),
            name=name,
            memory_total=mib * MIB,
            minor=i,
            pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
            numa_node=(0 if i < half else 1) if numa else None,
            compute_capability=(9, 0),
            mig_enabled=False,
            compute_mode=0,
        )
        for i, (name, mib) in enumerate(products)
    )
    return Inventory(gpus, dataclasses.replace(facts, **node))


def config(**overrides: Any) -> Config:
    return parse({"version": "v1", **overrides})


@pytest.mark.parametrize("preset", ["h200x2", "h200x8", "mixed"])
@pytest.mark.parametrize("mode", ["time-slicing", "sm-sharing", "exclusive"])
@pytest.mark.parametrize("size", ["256Mi", "1Gi", "5Gi"])
def test_presets_modes_sizes(preset: str, mode: str, size: str) -> None:
    inv = inventory(preset)
    cfg = config(defaultMode=mode, sliceSize=size, reservedMemory="1Gi")
    plan = build_plan(inv, cfg)
    slice_bytes = {"256Mi": 256 * MIB, "1Gi": GIB, "5Gi": 5 * GIB}[size]
    assert len(plan.gpus) == len(inv.gpus)
    for gpu, gp in zip(inv.gpus, plan.gpus, strict=True):
        assert gp.mode.value == mode
        assert gp.resource == cfg.resource_names.for_mode(gp.mode)
        assert gp.skipped is None
        if gp.mode is Mode.EXCLUSIVE:
            assert gp.device_ids == (gpu.uuid,)
            assert gp.enforcement == ()
            continue
        usable = gpu.memory_total - GIB
        assert gp.usable == usable
        assert gp.slice_size == slice_bytes
        assert len(gp.device_ids) == usable // slice_bytes
        assert gp.device_ids[0] == f"{gpu.uuid}::0"
        assert all(split_slice_id(d) == (gpu.uuid, n) for n, d in enumerate(gp.device_ids))
        assert all(len(d) <= MAX_DEVICE_ID_LEN for d in gp.device_ids)
    assert plan.resources == (cfg.resource_names.for_mode(Mode(mode)),)


def test_h200_default_numbers() -> None:
    plan = build_plan(inventory("h200x2"), Config())
    # 143771 MiB - 1024 MiB reserved = 142747 MiB → 139 whole GiB slices.
    assert [len(p.device_ids) for p in plan.gpus] == [139, 139]
    assert all(p.enforcement == (Enforcement.CUDA_MEMORY_LIMITS,) for p in plan.gpus)


def test_rules_first_match_wins_and_override_sizes() -> None:
    inv = inventory("mixed")
    cfg = config(
        gpus=[
            {"match": {"index": 0}, "mode": "sm-sharing", "sliceSize": "2Gi"},
            {"match": {"uuid": inv.gpus[1].uuid}, "mode": "exclusive"},
            {"match": {"product": "nvidia l4"}, "mode": "time-slicing", "reservedMemory": "512Mi"},
            {"match": {"index": 2}, "mode": "exclusive"},  # shadowed by the product rule
        ]
    )
    plan = build_plan(inv, cfg)
    modes = [p.mode for p in plan.gpus]
    assert modes == [Mode.SM_SHARING, Mode.EXCLUSIVE, Mode.TIME_SLICING, Mode.TIME_SLICING]
    assert plan.gpus[0].slice_size == 2 * GIB
    assert len(plan.gpus[0].device_ids) == (143771 - 1024) * MIB // (2 * GIB)
    assert plan.gpus[2].reserved == 512 * MIB
    assert len(plan.gpus[2].device_ids) == (23034 - 512) // 1024
    assert plan.resources == (
        cfg.resource_names.time_slicing,
        cfg.resource_names.sm_sharing,
        cfg.resource_names.exclusive,
    )
    errors, warnings = validate_against(cfg, inv)
    assert errors == []
    assert warnings == ["gpus[3].match: index=2 an earlier entry matches first"]


def test_unenforceable_time_slicing_on_a100_r580_is_skipped() -> None:
    plan = build_plan(inventory("a100x4-r580"), Config())
    assert plan.resources == ()
    for gp in plan.gpus:
        assert not gp.advertised
        assert gp.device_ids == ()
        assert gp.skipped is not None
        assert "driver 580.95.05 has no CUDA memory limits" in gp.skipped
        assert gp.enforcement == (Enforcement.NONE,)


def test_unenforceable_time_slicing_best_effort_is_advertised_with_none() -> None:
    plan = build_plan(inventory("a100x4-r580"), config(enforcement="best-effort"))
    assert all(p.advertised and p.enforcement == (Enforcement.NONE,) for p in plan.gpus)
    assert [len(p.device_ids) for p in plan.gpus] == [79] * 4


def test_a100_r580_sm_sharing_and_exclusive_need_no_cuda_limits() -> None:
    cfg = config(
        gpus=[
            {"match": {"index": 0}, "mode": "sm-sharing"},
            {"match": {"index": 1}, "mode": "exclusive"},
        ]
    )
    plan = build_plan(inventory("a100x4-r580"), cfg)
    assert plan.gpus[0].advertised and plan.gpus[0].enforcement == (Enforcement.MPS_PINNED_LIMIT,)
    assert plan.gpus[1].advertised and plan.gpus[1].enforcement == ()
    assert not plan.gpus[2].advertised


@pytest.mark.parametrize(
    ("node", "cfg", "fragment"),
    [
        ({"cuda_memory_limits": False}, {}, "has no CUDA memory limits (needs r615+)"),
        ({"cgroup_v2": False}, {}, "node runs cgroup v1"),
        ({"nvidia_ctk_present": False}, {}, "no nvidia-ctk at /usr/bin/nvidia-ctk"),
        ({}, {"deviceListStrategy": ["envvar"]}, "deviceListStrategy lacks cdi"),
        (
            {"nvidia_ctk_present": False},
            {"cdi": {"nvidiaCtkPath": "/opt/bin/ctk"}},
            "no nvidia-ctk at /opt/bin/ctk",
        ),
    ],
)
def test_each_failed_enforcement_condition_on_h200(
    node: dict[str, Any], cfg: dict[str, Any], fragment: str
) -> None:
    plan = build_plan(inventory("h200x2", **node), config(**cfg))
    for gp in plan.gpus:
        assert not gp.advertised
        assert gp.skipped is not None and fragment in gp.skipped
        assert gp.skipped.count(";") == 0  # only the one failed condition is named
    # best-effort advertises the same GPUs with enforcement none
    relaxed = build_plan(inventory("h200x2", **node), config(enforcement="best-effort", **cfg))
    assert all(p.advertised and p.enforcement == (Enforcement.NONE,) for p in relaxed.gpus)


def test_all_failed_conditions_are_named() -> None:
    plan = build_plan(
        inventory("h200x2", cuda_memory_limits=False, cgroup_v2=False, nvidia_ctk_present=False),
        Config(),
    )
    reason = plan.gpus[0].skipped or ""
    assert reason.count(";") == 2


def test_nvidia_ctk_argument_overrides_node_fact() -> None:
    inv = inventory("h200x2")
    assert not build_plan(inv, Config(), nvidia_ctk_present=False).gpus[0].advertised
    absent = inventory("h200x2", nvidia_ctk_present=False)
    assert build_plan(absent, Config(), nvidia_ctk_present=True).gpus[0].advertised


@pytest.mark.parametrize(
    ("protocol", "node", "enforcement", "reclaimable"),
    [
        (2, {}, (Enforcement.MPS_PINNED_LIMIT,), False),
        (3, {}, (Enforcement.CUDA_MEMORY_LIMITS, Enforcement.MPS_PINNED_LIMIT), True),
        (3, {"cgroup_v2": False}, (Enforcement.MPS_PINNED_LIMIT,), False),
        (3, {"cuda_memory_limits": False}, (Enforcement.MPS_PINNED_LIMIT,), False),
    ],
)
def test_sm_sharing_enforcement_and_reclaim(
    protocol: int, node: dict[str, Any], enforcement: tuple[Enforcement, ...], reclaimable: bool
) -> None:
    cfg = config(defaultMode="sm-sharing", mps={"protocolVersion": protocol})
    plan = build_plan(inventory("h200x2", **node), cfg)
    assert all(p.advertised for p in plan.gpus)
    assert {p.enforcement for p in plan.gpus} == {enforcement}
    assert {p.reclaimable for p in plan.gpus} == {reclaimable}


def test_time_slicing_is_never_reclaimable() -> None:
    assert not any(p.reclaimable for p in build_plan(inventory("h200x8"), Config()).gpus)


def test_mig_enabled_gpu_is_not_sliced() -> None:
    inv = inventory("h200x2")
    inv = Inventory((dataclasses.replace(inv.gpus[0], mig_enabled=True), inv.gpus[1]), inv.node)
    for mode in ("time-slicing", "sm-sharing", "exclusive"):
        plan = build_plan(inv, config(defaultMode=mode))
        assert not plan.gpus[0].advertised and "MIG" in (plan.gpus[0].skipped or "")
        assert plan.gpus[1].advertised


def test_lost_gpu_stays_advertised() -> None:
    inv = inventory("h200x2")
    inv = Inventory((dataclasses.replace(inv.gpus[0], lost=True), inv.gpus[1]), inv.node)
    assert build_plan(inv, Config()).gpus[0].advertised


def test_numa_all_or_none() -> None:
    plan = build_plan(inventory("h200x8"), Config())
    assert [plan.numa_node(p.uuid) for p in plan.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    inv = inventory("h200x8")
    one_missing = Inventory(
        (dataclasses.replace(inv.gpus[0], numa_node=None), *inv.gpus[1:]), inv.node
    )
    plan = build_plan(one_missing, Config())
    assert all(plan.numa_node(p.uuid) is None for p in plan.gpus)


def test_slice_larger_than_usable_is_an_error_naming_the_field() -> None:
    inv = inventory("mixed")
    errors, _ = validate_against(config(sliceSize="32Gi"), inv)
    assert len(errors) == 2 and all(e.startswith("sliceSize: 32Gi is larger") for e in errors)
    cfg = config(
        gpus=[{"match": {"product": "NVIDIA L4"}, "mode": "sm-sharing", "sliceSize": "24Gi"}]
    )
    errors, _ = validate_against(cfg, inv)
    assert len(errors) == 2 and all(e.startswith("gpus[0].sliceSize: 24Gi") for e in errors)
    errors, _ = validate_against(config(reservedMemory="200Gi"), inv)
    assert len(errors) == 4 and all(
        e.startswith("reservedMemory: 200Gi leaves nothing") for e in errors
    )


def test_unmatched_rule_is_a_warning() -> None:
    errors, warnings = validate_against(
        config(gpus=[{"match": {"index": 7}, "mode": "exclusive"}]), inventory("h200x2")
    )
    assert errors == []
    assert warnings == ["gpus[0].match: index=7 matches no GPU on this node"]


def test_skipped_gpu_is_a_warning() -> None:
    errors, warnings = validate_against(Config(), inventory("a100x4-r580"))
    assert errors == []
    assert len(warnings) == 4 and all("not advertised" in w for w in warnings)


def test_list_and_watch_limit_names_slice_size() -> None:
    inv = inventory("h200x8")
    ok = config(sliceSize="256Mi")
    errors, _ = validate_against(ok, inv)
    assert errors == []
    plan = build_plan(inv, ok)
    size = list_and_watch_size(plan, ok.resource_names.time_slicing)
    assert 100_000 < size < 1024 * 1024
    errors, _ = validate_against(config(sliceSize="16Mi"), inv)
    assert len(errors) == 1
    assert errors[0].startswith("sliceSize: nvidia.com/gpu-fraction would advertise 71")
    assert "ListAndWatch" in errors[0]


def test_duplicate_match_is_an_error_at_parse() -> None:
    with pytest.raises(ConfigError) as info:
        config(
            gpus=[
                {"match": {"uuid": "GPU-a"}, "mode": "exclusive"},
                {"match": {"uuid": "GPU-a"}, "mode": "exclusive"},
            ]
        )
    assert info.value.problems == ["gpus[1].match: same match as gpus[0].match"]


def test_reload_holds_back_allocated_gpu() -> None:
    inv = inventory("h200x2")
    old = build_plan(inv, Config())
    new = build_plan(inv, config(defaultMode="sm-sharing", sliceSize="2Gi"))
    gpu0 = inv.gpus[0].uuid
    merged, held = merge_reload(old, new, {gpu0})
    assert held == [gpu0]
    assert merged.gpus[0] == old.gpus[0]
    assert merged.gpus[1] == new.gpus[1]
    assert merged.resources == (
        Config().resource_names.time_slicing,
        Config().resource_names.sm_sharing,
    )
    # once idle, the change goes through
    merged2, held2 = merge_reload(merged, new, set())
    assert held2 == [] and merged2 == new


def test_reload_allows_harmless_change_on_allocated_gpu() -> None:
    inv = inventory("h200x2")
    old = build_plan(inv, Config())
    more = build_plan(inv, config(reservedMemory="512Mi"))  # same size, one more slice
    merged, held = merge_reload(old, more, {inv.gpus[0].uuid})
    assert held == [] and merged == more
    fewer = build_plan(inv, config(reservedMemory="8Gi"))  # would drop slice IDs
    merged, held = merge_reload(old, fewer, {inv.gpus[0].uuid})
    assert held == [inv.gpus[0].uuid]


def test_plan_is_pure() -> None:
    inv = inventory("mixed")
    cfg = config(gpus=[{"match": {"index": 0}, "mode": "sm-sharing"}])
    assert build_plan(inv, cfg) == build_plan(inv, cfg)


def test_rule_objects_match_directly() -> None:
    rule = GpuRule(GpuMatch(product="NVIDIA H200"), Mode.EXCLUSIVE)
    plan = build_plan(inventory("h200x2"), Config(gpus=(rule,)))
    assert {p.mode for p in plan.gpus} == {Mode.EXCLUSIVE}


def test_the_r580_example_serves_every_gpu_of_an_r580_node() -> None:
    """`examples/r580.yaml` passes `check-config --simulate a100x4-r580` and plans slices on
    every GPU there, where the default config serves none."""
    example = Path(__file__).resolve().parent.parent / "examples" / "r580.yaml"
    checked = subprocess.run(
        [sys.executable, "-m", "deviceplugin", "check-config", str(example),
         "--simulate", "a100x4-r580"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "not advertised" not in checked.stdout + checked.stderr
    assert build_plan(inventory("a100x4-r580"), Config()).resources == ()
    plan = build_plan(inventory("a100x4-r580"), load(example))
    assert plan.resources and all(g.advertised for g in plan.gpus)
    assert all(Enforcement.NONE not in g.enforcement for g in plan.gpus)
