"""Simulation presets, YAML spec validation, the simulated sysfs, and the driver CDI spec."""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplugin.cdi.specs import validate_spec
from deviceplugin.model import MIB
from deviceplugin.simulate.cdi import DRIVER_KIND, write_driver_cdi_spec
from deviceplugin.simulate.specs import PRESETS, SpecError, load_spec, parse_spec

UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def test_presets_are_deterministic_with_valid_unique_uuids() -> None:
    all_uuids: list[str] = []
    for name in PRESETS:
        a, b = load_spec(name), load_spec(name)
        assert a == b
        assert all(UUID.match(g.uuid) for g in a.gpus)
        all_uuids += [g.uuid for g in a.gpus]
        assert len({g.pci_bus_id for g in a.gpus}) == len(a.gpus)
        assert [g.minor for g in a.gpus] == list(range(len(a.gpus)))
    assert len(set(all_uuids)) == len(all_uuids)


def test_h200_presets() -> None:
    for name, count in (("h200x2", 2), ("h200x8", 8)):
        spec = load_spec(name)
        assert len(spec.gpus) == count
        g = spec.gpus[0]
        assert (g.name, g.memory_total, g.compute_capability) == (
            "NVIDIA H200",
            143771 * MIB,
            (9, 0),
        )
        assert spec.driver_branch == 615 and spec.cuda_driver_version == 13040
        facts = spec.node_facts()
        assert facts.cuda_memory_limits and facts.cgroup_v2 and facts.nvidia_ctk_present
        assert {g.numa_node for g in spec.gpus} == {0, 1}


def test_a100_r580_lacks_memory_limits_and_mixed_has_two_products() -> None:
    a100 = load_spec("a100x4-r580")
    assert len(a100.gpus) == 4 and a100.driver_branch == 580
    assert a100.gpus[0].memory_total == 81920 * MIB and a100.gpus[0].mig_capable
    assert not a100.node_facts().cuda_memory_limits
    assert not a100.memory_limits_symbol
    mixed = load_spec("mixed")
    assert len({g.name for g in mixed.gpus}) == 2


def _write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_yaml_spec_file_with_defaults_and_count(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        {
            "driverVersion": "615.43.02",
            "cudaDriverVersion": "13.4",
            "cgroupVersion": 1,
            "nvidiaCtk": False,
            "privileged": False,
            "gpus": [
                {"name": "NVIDIA L4", "memoryMiB": 23034, "count": 3, "computeCapability": "8.9"},
                {
                    "name": "NVIDIA H200",
                    "memoryMiB": 143771,
                    "uuid": "GPU-00000000-1111-2222-3333-444444444444",
                    "numaNode": 1,
                    "computeMode": "ExclusiveProcess",
                },
            ],
        },
    )
    spec = load_spec(str(path))
    assert spec.name == "node"
    assert [g.index for g in spec.gpus] == [0, 1, 2, 3]
    assert spec.gpus[3].uuid == "GPU-00000000-1111-2222-3333-444444444444"
    assert spec.gpus[3].compute_mode == 3 and spec.gpus[3].numa_node == 1
    assert spec.gpus[0].compute_capability == (8, 9)
    assert spec.cuda_driver_version == 13040
    facts = spec.node_facts()
    assert not facts.cgroup_v2 and not facts.nvidia_ctk_present and not spec.privileged
    assert load_spec(path) == spec  # a Path works as well as a string


def test_validation_names_every_bad_field(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        {
            "driverVersion": "r615",
            "cgroupVersion": 3,
            "nvidiaCtk": "yes",
            "colour": "green",
            "gpus": [
                {"name": "A", "memoryMiB": -1, "uuid": "GPU-nope", "bogus": 1},
                {"memoryMiB": 10, "computeCapability": "nine", "computeMode": "Shared"},
                {"name": "B", "memoryMiB": 10, "count": 2, "minor": 3, "migEnabled": True},
            ],
        },
    )
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    problems = info.value.problems
    fields = {p.split(":", 1)[0] for p in problems}
    assert fields >= {
        "driverVersion",
        "cgroupVersion",
        "nvidiaCtk",
        "colour",
        "gpus[0].memoryMiB",
        "gpus[0].uuid",
        "gpus[0].bogus",
        "gpus[1].name",
        "gpus[1].computeCapability",
        "gpus[1].computeMode",
        "gpus[2].minor",
        "gpus[2].migEnabled",
    }
    assert any(p.startswith("colour: unknown field") for p in problems)
    assert str(path) in str(info.value)


def test_missing_required_fields_and_duplicates() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({"gpus": []}, source="t")
    assert {p.split(":")[0] for p in info.value.problems} == {"driverVersion", "gpus"}
    uuid = "GPU-00000000-1111-2222-3333-444444444444"
    dup = {
        "driverVersion": "615.1",
        "gpus": [{"name": "A", "memoryMiB": 1, "reservedMiB": 0, "uuid": uuid}] * 2,
    }
    with pytest.raises(SpecError) as info:
        parse_spec(dup, source="t")
    assert any("duplicate" in p and p.startswith("gpus[1].uuid") for p in info.value.problems)


def test_unknown_preset_or_unreadable_file() -> None:
    with pytest.raises(SpecError) as info:
        load_spec("h100x3")
    assert "h200x2" in str(info.value)


def test_gpu_lookup_by_index_or_uuid() -> None:
    spec = load_spec("h200x2")
    assert spec.gpu("1") == spec.gpus[1]
    assert spec.gpu(spec.gpus[0].uuid) == spec.gpus[0]
    with pytest.raises(KeyError):
        spec.gpu("2")


def test_simulated_sysfs_tree(tmp_path: Path) -> None:
    spec = load_spec("h200x2")
    spec.write_sysfs(tmp_path)
    dev = tmp_path / "bus/pci/devices/0000:2a:00.0/numa_node"
    assert spec.gpus[1].pci_bus_id == "00000000:2A:00.0"
    assert dev.read_text().strip() == str(spec.gpus[1].numa_node)
    assert (tmp_path / "fs/cgroup/cgroup.controllers").is_file()


# ---- driver CDI spec ----------------------------------------------------------------------


def test_driver_cdi_spec_names_every_gpu_by_index_and_uuid(tmp_path: Path) -> None:
    spec = load_spec("h200x8")
    path = write_driver_cdi_spec(spec, tmp_path / "cdi")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    body = yaml.safe_load(path.read_text())
    assert validate_spec(body) == []
    assert body["kind"] == DRIVER_KIND
    devices = {d["name"]: d["containerEdits"] for d in body["devices"]}
    for g in spec.gpus:
        node = [{"path": f"/dev/nvidia{g.minor}"}]
        assert devices[str(g.index)]["deviceNodes"] == node
        assert devices[g.uuid]["deviceNodes"] == node
    assert len(devices["all"]["deviceNodes"]) == 8
    shared = [n["path"] for n in body["containerEdits"]["deviceNodes"]]
    assert "/dev/nvidiactl" in shared
    assert list((tmp_path / "cdi").iterdir()) == [path]  # no temp file left behind


def test_driver_cdi_spec_rewrite_replaces_the_file(tmp_path: Path) -> None:
    write_driver_cdi_spec(load_spec("h200x8"), tmp_path)
    path = write_driver_cdi_spec(load_spec("h200x2"), tmp_path, kind="example.com/gpu")
    body = yaml.safe_load(path.read_text())
    assert body["kind"] == "example.com/gpu"
    assert len(body["devices"]) == 2 * 2 + 1
