"""Isolation between tenants, for every mode and device-list strategy.

Two containers on two GPUs through the real Allocator: each answer (env, mounts, device
nodes, CDI device names, and the CDI spec files parsed from the CDI dir) names only its own
GPU, its own GPU's MPS pipe and shm dirs, and its own allocation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.config.settings import parse
from deviceplugin.dpapi.allocator import CONTROL_DEVICE_NODES, Allocator, Grant
from deviceplugin.health.board import HealthBoard
from deviceplugin.ledger.store import Ledger
from deviceplugin.model import GpuUuid, Mode
from deviceplugin.plan import GpuPlan, build_plan
from tests.test_plan import inventory

STRATEGIES = [["cdi"], ["envvar"], ["device-nodes"], ["cdi", "envvar", "device-nodes"]]
MODES = ["time-slicing", "sm-sharing", "exclusive"]


class ReadyMps:
    def ensure(self, gpu: GpuUuid) -> bool:
        return True

    def wait_ready(self, gpu: GpuUuid, timeout: float) -> bool:
        return True

    def memory_accounting(self, gpu: GpuUuid) -> bool:
        return True


def _specs(cdi_dir: Path) -> dict[str, dict[str, Any]]:
    """Every spec this plugin wrote, by device name (one device per spec file)."""
    out = {}
    for path in sorted(cdi_dir.glob(f"{cdi_specs.SPEC_PREFIX}*.json")):
        spec = json.loads(path.read_text())
        assert cdi_specs.validate_spec(spec) == [], path
        (device,) = spec["devices"]
        out[device["name"]] = spec
    return out


def _grants(tmp_path: Path, mode: str, strategy: list[str]) -> list[tuple[list[GpuPlan], Grant]]:
    config = parse(
        {
            "version": "v1",
            "deviceListStrategy": strategy,
            "gpus": [{"match": {"index": i}, "mode": mode} for i in range(4)],
        }
    )
    plan = build_plan(inventory("h200x8"), config)
    advertised = [gp for gp in plan.gpus if gp.advertised]
    if not advertised:  # e.g. time-slicing without CDI: no enforcement, so nothing offered
        assert all(gp.skipped for gp in plan.gpus[:4]), plan.gpus[0]
        return []
    allocator = Allocator(
        lambda: plan,
        lambda: config,
        tmp_path / "cdi",
        tmp_path / "mps",
        Ledger(tmp_path / "state"),
        HealthBoard(),
        ReadyMps(),
    )
    out = []
    if Mode(mode) is Mode.EXCLUSIVE:
        tenants = [advertised[0:2], advertised[2:4]]  # two whole GPUs each
    else:
        tenants = [[advertised[0]], [advertised[1]]]
    for plans in tenants:
        ids = [d for gp in plans for d in gp.device_ids[:3]]
        out.append((plans, allocator.allocate(plans[0].resource, ids)))
    return out


@pytest.mark.parametrize("strategy", STRATEGIES, ids="+".join)
@pytest.mark.parametrize("mode", MODES)
def test_each_container_sees_only_its_own(tmp_path: Path, mode: str, strategy: list[str]) -> None:
    grants = _grants(tmp_path, mode, strategy)
    if mode != "time-slicing" or "cdi" in strategy:
        assert len(grants) == 2
    specs = _specs(tmp_path / "cdi") if (tmp_path / "cdi").exists() else {}
    all_uuids = {gp.uuid for plans, _ in grants for gp in plans}
    for plans, grant in grants:
        mine = {gp.uuid for gp in plans}
        others = all_uuids - mine
        # Device nodes: its own GPUs' nodes plus the driver's control nodes, nothing else.
        own_nodes = {f"/dev/nvidia{gp.gpu.minor}" for gp in plans} | set(CONTROL_DEVICE_NODES)
        assert {host for _, host, _ in grant.device_specs} <= own_nodes
        if "device-nodes" in strategy:
            assert {host for _, host, _ in grant.device_specs} == own_nodes
        # Plain env and mounts (envvar), when delivered that way.
        if grant.envs:
            assert set(grant.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == mine
        own_dirs = {tmp_path / "mps" / plans[0].uuid / d for d in ("pipe", "shm")}
        for _, host, _ in grant.mounts:
            assert Path(host) in own_dirs
        # CDI: the driver's device for its own GPUs and its own allocation's device only.
        own_devices = [n for n in grant.cdi_devices if n.startswith(cdi_specs.KIND + "=")]
        driver = {n.partition("=")[2] for n in grant.cdi_devices if n not in own_devices}
        assert driver <= mine
        if "cdi" in strategy and plans[0].mode is Mode.EXCLUSIVE:
            assert driver == mine and own_devices == []  # whole GPUs: the driver's devices
        elif "cdi" in strategy:
            assert driver == mine and len(own_devices) == 1
            name = own_devices[0].partition("=")[2]
            edits = specs[name]["devices"][0]["containerEdits"]
            env = dict(e.split("=", 1) for e in edits.get("env", []))
            assert "NVIDIA_VISIBLE_DEVICES" not in env  # the driver's device selects the GPU
            pipes = {m["hostPath"] for m in edits.get("mounts", [])}
            want = {str(d) for d in own_dirs}
            assert pipes == (want if plans[0].mode is Mode.SM_SHARING else set())
            text = json.dumps(specs[name])
            assert not any(other in text for other in others)
        else:
            assert own_devices == []
        assert set(grant.annotations.get("gpu-fraction.dev/gpu", "").split(",")) == mine
    if "cdi" in strategy and Mode(mode) is not Mode.EXCLUSIVE:
        # One spec per allocation, and the two never share a device name.
        assert len(specs) == len(grants) == 2
