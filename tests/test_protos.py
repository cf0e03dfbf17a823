"""The committed generated modules match protos/, and the wire names match the kubelet's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from deviceplugin._pb import deviceplugin_v1beta1_pb2 as dp
from deviceplugin._pb import podresources_v1_pb2 as pr

ROOT = Path(__file__).resolve().parent.parent


def test_generated_modules_are_current(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(ROOT / "hack" / "gen-protos.sh"), str(tmp_path)], check=True, env=env)
    committed = ROOT / "deviceplugin" / "_pb"
    generated = sorted(p.name for p in tmp_path.iterdir() if p.suffix in {".py", ".pyi"})
    assert generated == sorted(p.name for p in committed.iterdir() if p.suffix in {".py", ".pyi"})
    for name in generated:
        assert (tmp_path / name).read_text() == (committed / name).read_text(), (
            f"{name} is stale: run hack/gen-protos.sh"
        )


def _fields(msg: type) -> dict[str, tuple[int, int]]:
    return {f.name: (f.number, f.type) for f in msg.DESCRIPTOR.fields}  # type: ignore[attr-defined]


def test_device_plugin_wire_names() -> None:
    assert dp.DESCRIPTOR.package == "v1beta1"
    services = {
        s.name: [m.name for m in s.methods] for s in dp.DESCRIPTOR.services_by_name.values()
    }
    assert services == {
        "Registration": ["Register"],
        "DevicePlugin": [
            "GetDevicePluginOptions",
            "ListAndWatch",
            "GetPreferredAllocation",
            "Allocate",
            "PreStartContainer",
        ],
    }
    lw = dp.DESCRIPTOR.services_by_name["DevicePlugin"].methods_by_name["ListAndWatch"]
    assert lw.server_streaming and not lw.client_streaming
    t_str, t_bool, t_msg, t_int64, t_int32 = 9, 8, 11, 3, 5
    assert _fields(dp.RegisterRequest) == {
        "version": (1, t_str),
        "endpoint": (2, t_str),
        "resource_name": (3, t_str),
        "options": (4, t_msg),
    }
    assert _fields(dp.Device) == {"ID": (1, t_str), "health": (2, t_str), "topology": (3, t_msg)}
    assert _fields(dp.NUMANode) == {"ID": (1, t_int64)}
    assert _fields(dp.ContainerPreferredAllocationRequest) == {
        "available_deviceIDs": (1, t_str),
        "must_include_deviceIDs": (2, t_str),
        "allocation_size": (3, t_int32),
    }
    assert _fields(dp.ContainerAllocateRequest) == {"devices_ids": (1, t_str)}
    resp = _fields(dp.ContainerAllocateResponse)
    assert [resp[k][0] for k in ("envs", "mounts", "devices", "annotations", "cdi_devices")] == [
        1,
        2,
        3,
        4,
        5,
    ]
    assert _fields(dp.DeviceSpec) == {
        "container_path": (1, t_str),
        "host_path": (2, t_str),
        "permissions": (3, t_str),
    }
    assert _fields(dp.DevicePluginOptions) == {
        "pre_start_required": (1, t_bool),
        "get_preferred_allocation_available": (2, t_bool),
    }


def test_pod_resources_wire_names() -> None:
    assert pr.DESCRIPTOR.package == "v1"
    svc = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert [m.name for m in svc.methods] == ["List", "GetAllocatableResources", "Get"]
    assert _fields(pr.ContainerDevices) == {
        "resource_name": (1, 9),
        "device_ids": (2, 9),
        "topology": (3, 11),
    }
    assert list(_fields(pr.ContainerResources)) == [
        "name",
        "devices",
        "cpu_ids",
        "memory",
        "dynamic_resources",
    ]
