"""NvmlSession and the inventory on the fake NVML (real pynvml underneath), plus the views."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pynvml
import pytest

from deviceplugin.config.settings import Config
from deviceplugin.inventory.gpus import (
    read_inventory,
    read_node_facts,
    read_numa_node,
    sysfs_pci_name,
)
from deviceplugin.inventory.nvml import (
    NO_DRIVER_MESSAGE,
    GpuLost,
    NoPermission,
    NvmlSession,
    NvmlUnavailable,
    UnknownGpu,
)
from deviceplugin.model import MIB, GpuUuid
from deviceplugin.plan import build_plan
from deviceplugin.report import format_inventory_table, inventory_report
from deviceplugin.simulate.specs import PRESETS, SimSpec, parse_spec
from tests.conftest import MakeFake


def _sim_inventory(spec: SimSpec, sysfs: Path) -> Any:
    spec.write_sysfs(sysfs)
    with NvmlSession.open() as session:
        return read_inventory(session, sysfs, "/nonexistent/nvidia-ctk", spec.node_facts())


@pytest.mark.parametrize("preset", PRESETS)
def test_inventory_on_every_preset(make_fake: MakeFake, tmp_path: Path, preset: str) -> None:
    fake = make_fake(preset)
    inv = _sim_inventory(fake.spec, tmp_path / "sys")
    assert [g.uuid for g in inv.gpus] == [g.uuid for g in fake.spec.gpus]
    for got, sim in zip(inv.gpus, fake.spec.gpus, strict=True):
        assert got.index == sim.index
        assert got.name == sim.name
        assert got.memory_total == sim.memory_total
        assert got.minor == sim.minor
        assert got.pci_bus_id == sim.pci_bus_id
        assert got.numa_node == sim.numa_node
        assert got.compute_capability == sim.compute_capability
        assert got.mig_enabled is False
        assert got.compute_mode == 0
        assert not got.lost
    assert inv.node == fake.spec.node_facts()


def test_h200_and_a100_presets_differ_where_the_driver_does(
    make_fake: MakeFake, tmp_path: Path
) -> None:
    h200 = _sim_inventory(make_fake("h200x8").spec, tmp_path / "a")
    assert len(h200.gpus) == 8
    assert {g.numa_node for g in h200.gpus} == {0, 1}
    assert h200.gpus[0].memory_total == 143771 * MIB
    assert h200.node.cuda_memory_limits and h200.node.cgroup_v2 and h200.node.nvidia_ctk_present
    a100 = _sim_inventory(make_fake("a100x4-r580").spec, tmp_path / "b")
    assert a100.gpus[0].memory_total == 81920 * MIB
    assert a100.gpus[0].compute_capability == (8, 0)
    assert not a100.node.cuda_memory_limits


def _host_tree(root: Path, cgroup_v2: bool) -> tuple[Path, str]:
    (root / "fs" / "cgroup").mkdir(parents=True)
    if cgroup_v2:
        (root / "fs" / "cgroup" / "cgroup.controllers").write_text("cpu memory\n")
    ctk = root / "nvidia-ctk"
    ctk.write_text("#!/bin/sh\n")
    ctk.chmod(0o755)
    return root, str(ctk)


def test_nvidia_ctk_is_looked_up_under_the_host_root(make_fake: MakeFake, tmp_path: Path) -> None:
    """In the DaemonSet the host's filesystem is at /host: a host path such as
    /usr/local/nvidia/toolkit/nvidia-ctk is found there, and nowhere else."""
    make_fake("h200x2")
    sysfs, _ = _host_tree(tmp_path / "node", cgroup_v2=True)
    host = tmp_path / "host"
    ctk = host / "usr" / "local" / "nvidia" / "toolkit" / "nvidia-ctk"
    ctk.parent.mkdir(parents=True)
    ctk.write_text("#!/bin/sh\n")
    ctk.chmod(0o755)
    host_path = "/usr/local/nvidia/toolkit/nvidia-ctk"
    with NvmlSession.open() as session:
        assert read_node_facts(session, sysfs, host_path, host).nvidia_ctk_present
        assert not read_node_facts(session, sysfs, host_path).nvidia_ctk_present
        ctk.chmod(0o644)  # present but not executable: the hook could not run
        assert not read_node_facts(session, sysfs, host_path, host).nvidia_ctk_present


def test_real_node_facts_need_branch_symbol_cgroup_and_ctk(
    make_fake: MakeFake, tmp_path: Path
) -> None:
    fake = make_fake("h200x2")
    sysfs, ctk = _host_tree(tmp_path / "v2", cgroup_v2=True)
    with NvmlSession.open() as session:
        facts = read_node_facts(session, sysfs, ctk)
        assert facts.driver_version == "615.43.02"
        assert facts.cuda_driver_version == 13040
        assert facts.cuda_memory_limits and facts.cgroup_v2 and facts.nvidia_ctk_present
        assert not read_node_facts(session, sysfs, str(tmp_path / "none")).nvidia_ctk_present
        # A 615 driver without the symbol does not count.
        del fake.library.nvmlDeviceSetMemoryLimits_v1
        pynvml._nvmlGetFunctionPointer_cache.clear()
        assert not read_node_facts(session, sysfs, ctk).cuda_memory_limits
    make_fake("a100x4-r580")
    v1, ctk1 = _host_tree(tmp_path / "v1", cgroup_v2=False)
    with NvmlSession.open() as session:
        facts = read_node_facts(session, v1, ctk1)
    assert not facts.cuda_memory_limits
    assert not facts.cgroup_v2


def test_numa_path_and_missing_affinity(tmp_path: Path) -> None:
    assert sysfs_pci_name("00000000:3B:00.0") == "0000:3b:00.0"
    assert sysfs_pci_name("00000001:AB:00.0") == "0001:ab:00.0"
    dev = tmp_path / "bus" / "pci" / "devices" / "0000:3b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("-1\n")
    assert read_numa_node(tmp_path, "00000000:3B:00.0") is None
    (dev / "numa_node").write_text("1\n")
    assert read_numa_node(tmp_path, "00000000:3B:00.0") == 1
    assert read_numa_node(tmp_path, "00000000:5D:00.0") is None


def test_mig_enabled_is_read(make_fake: MakeFake, tmp_path: Path) -> None:
    spec = parse_spec(
        {
            "driverVersion": "580.95.05",
            "gpus": [
                {"name": "NVIDIA A100", "memoryMiB": 81920, "migCapable": True, "migEnabled": True},
                {"name": "NVIDIA T4", "memoryMiB": 15360},
            ],
        },
        source="t",
    )
    make_fake(spec)
    inv = _sim_inventory(spec, tmp_path)
    assert [g.mig_enabled for g in inv.gpus] == [True, False]


def test_a_lost_gpu_is_listed_and_the_others_still_read(
    make_fake: MakeFake, tmp_path: Path
) -> None:
    fake = make_fake("h200x2")
    fake.set_lost(1)
    inv = _sim_inventory(fake.spec, tmp_path)
    ok, lost = inv.gpus
    assert not ok.lost and ok.memory_total == 143771 * MIB
    assert lost.lost and lost.uuid == fake.spec.gpus[1].uuid
    assert lost.pci_bus_id == fake.spec.gpus[1].pci_bus_id  # identity still answers
    assert lost.memory_total == 0  # best effort: NVML refuses the rest


def test_a_gpu_lost_before_its_identity_gets_a_placeholder(
    make_fake: MakeFake, tmp_path: Path
) -> None:
    fake = make_fake("h200x2", lost_hides_identity=True)
    fake.set_lost(0)
    with NvmlSession.open() as session:
        assert session.lost_indices == (0,)
        inv = read_inventory(session, tmp_path, "/x", fake.spec.node_facts())
    assert [g.lost for g in inv.gpus] == [True, False]
    assert inv.gpus[0].index == 0 and inv.gpus[0].uuid.startswith("GPU-lost-index-")
    assert inv.gpus[1].uuid == fake.spec.gpus[1].uuid


def test_no_library_gives_the_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "CDLL", no_library)
    pynvml._nvmlGetFunctionPointer_cache.clear()
    with pytest.raises(NvmlUnavailable) as info:
        NvmlSession.open()
    assert str(info.value) == NO_DRIVER_MESSAGE
    assert info.value.code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND


def test_driver_not_loaded_gives_the_clear_message(make_fake: MakeFake) -> None:
    make_fake(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(NvmlUnavailable) as info:
        NvmlSession.open()
    assert str(info.value) == (
        "no NVIDIA driver found on this node; use --simulate PRESET to run on simulated GPUs"
    )


def test_session_maps_event_handles_by_address_while_uuid_lookup_fails(
    make_fake: MakeFake,
) -> None:
    fake = make_fake("h200x2")
    with NvmlSession.open() as session:
        uuids = list(session.handles())
        assert uuids == [g.uuid for g in fake.spec.gpus]
        es = pynvml.nvmlEventSetCreate()
        for h in session.handles().values():
            pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
        fake.inject_xid(1, 79)
        ev = pynvml.nvmlEventSetWait_v2(es, 1000)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetHandleByUUID(uuids[0])
        assert session.uuid_for_handle(ev.device) == uuids[1]
        assert session.uuid_for_handle(pynvml.nvmlDeviceGetHandleByIndex(0)) == uuids[0]
        assert not session.probe(uuids[1])
        assert session.probe(uuids[0])
        with pytest.raises(GpuLost):
            session.get_compute_mode(uuids[1])


def test_session_compute_mode_and_permissions(make_fake: MakeFake) -> None:
    spec = parse_spec(
        {
            "driverVersion": "615.43.02",
            "privileged": False,
            "gpus": [{"name": "X", "memoryMiB": 1024}],
        },
        source="t",
    )
    make_fake(spec)
    with NvmlSession.open() as session:
        uuid = spec.gpus[0].uuid
        assert session.get_compute_mode(uuid) == 0
        with pytest.raises(NoPermission) as info:
            session.set_compute_mode(uuid, 3)
        assert "needs root" in str(info.value)
        with pytest.raises(UnknownGpu):
            session.get_compute_mode(GpuUuid("GPU-00000000-0000-0000-0000-000000000000"))
    fake = make_fake("h200x2")
    with NvmlSession.open() as session:
        session.set_compute_mode(fake.spec.gpus[0].uuid, 3)
    assert fake.compute_mode(0) == 3


def test_session_recovery_action(make_fake: MakeFake) -> None:
    fake = make_fake("h200x2")
    with NvmlSession.open() as session:
        uuid = fake.spec.gpus[0].uuid
        assert session.recovery_action(uuid) == 0
        fake.inject_xid(0, 119)
        assert session.recovery_action(uuid) == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
        fake.recover(0)
        assert session.recovery_action(uuid) == 0
    old = parse_spec(
        {"driverVersion": "535.161.08", "gpus": [{"name": "NVIDIA A10", "memoryMiB": 23028}]},
        source="t",
    )
    make_fake(old)
    with NvmlSession.open() as session:
        assert session.recovery_action(old.gpus[0].uuid) is None


def test_session_processes_and_library_mismatch(make_fake: MakeFake) -> None:
    fake = make_fake("h200x2")
    fake.add_process(0, 10, 1 << 30)
    fake.add_process(0, 11, 2 << 30, mps_client=True)
    with NvmlSession.open() as session:
        uuid = fake.spec.gpus[0].uuid
        procs = session.running_processes(uuid)
        assert [(p.pid, p.used_memory, p.mps_client) for p in procs] == [
            (10, 1 << 30, False),
            (11, 2 << 30, True),
        ]
        del fake.library.nvmlDeviceGetMPSComputeRunningProcesses_v3
        pynvml._nvmlGetFunctionPointer_cache.clear()
        assert [p.pid for p in session.running_processes(uuid)] == [10]


def test_shutdown_is_idempotent(make_fake: MakeFake) -> None:
    make_fake("h200x2")
    session = NvmlSession.open()
    session.shutdown()
    session.shutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_report_and_table_without_and_with_plan(make_fake: MakeFake, tmp_path: Path) -> None:
    fake = make_fake("h200x2")
    fake.set_lost(1)
    inv = _sim_inventory(fake.spec, tmp_path)
    bare = inventory_report(inv, None)
    assert json.loads(json.dumps(bare)) == bare
    assert bare["node"]["cudaDriverVersion"] == "13.4"
    first, second = bare["gpus"]
    assert first["memoryMiB"] == 143771 and first["mode"] is None and first["slices"] is None
    assert (second["lost"], second["health"]) == (True, "Unhealthy")
    table = format_inventory_table(bare)
    lines = table.splitlines()
    assert lines[1].split() == [
        "GPU",
        "UUID",
        "NAME",
        "MEMORY",
        "MODE",
        "SLICES",
        "ENFORCEMENT",
        "HEALTH",
    ]
    assert fake.spec.gpus[0].uuid in lines[2] and " - " in lines[2]
    assert "(lost)" in lines[3]
    plan = build_plan(inv, Config())
    planned = inventory_report(inv, plan)
    p0 = plan.for_gpu(fake.spec.gpus[0].uuid)
    assert p0 is not None
    assert planned["gpus"][0]["slices"] == len(p0.device_ids)
    assert planned["gpus"][0]["mode"] == "time-slicing"
    assert planned["gpus"][0]["enforcement"] == [str(e) for e in p0.enforcement]
    assert str(len(p0.device_ids)) in format_inventory_table(planned).splitlines()[2]


def test_inventory_reads_nothing_from_the_host_in_simulation(
    make_fake: MakeFake, tmp_path: Path
) -> None:
    # Spec says cgroup v1 and no nvidia-ctk; the host running the test does not matter.
    spec = parse_spec(
        {
            "driverVersion": "615.43.02",
            "cgroupVersion": 1,
            "nvidiaCtk": False,
            "gpus": [{"name": "NVIDIA H200", "memoryMiB": 143771}],
        },
        source="t",
    )
    make_fake(spec)
    inv = _sim_inventory(spec, tmp_path)
    assert not inv.node.cgroup_v2 and not inv.node.nvidia_ctk_present
    assert inv.node.cuda_memory_limits  # the driver part holds; the plan reports the rest
    assert os.path.exists(tmp_path / "fs" / "cgroup")
