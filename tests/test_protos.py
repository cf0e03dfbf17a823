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


def _methods(module: object, service: str) -> dict[str, tuple[bool, bool]]:
    svc = module.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
    return {m.name: (m.client_streaming, m.server_streaming) for m in svc.methods}


def test_plugin_registration_wire_names() -> None:
    from deviceplugin._pb import pluginregistration_v1_pb2 as reg

    # The upstream package has no version: the kubelet calls /pluginregistration.Registration/…
    assert reg.DESCRIPTOR.package == "pluginregistration"
    svc = reg.DESCRIPTOR.services_by_name["Registration"]
    assert svc.full_name == "pluginregistration.Registration"
    assert _methods(reg, "Registration") == {
        "GetInfo": (False, False),
        "NotifyRegistrationStatus": (False, False),
    }
    t_str, t_bool = 9, 8
    assert _fields(reg.PluginInfo) == {
        "type": (1, t_str),
        "name": (2, t_str),
        "endpoint": (3, t_str),
        "supported_versions": (4, t_str),
    }
    assert _fields(reg.RegistrationStatus) == {
        "plugin_registered": (1, t_bool),
        "error": (2, t_str),
    }
    assert _fields(reg.InfoRequest) == {} and _fields(reg.RegistrationStatusResponse) == {}


def test_dra_plugin_wire_names() -> None:
    from deviceplugin._pb import dra_v1_pb2 as v1
    from deviceplugin._pb import dra_v1beta1_pb2 as v1beta1

    t_str, t_msg = 9, 11
    for module, version in ((v1, "v1"), (v1beta1, "v1beta1")):
        package = f"k8s.io.kubelet.pkg.apis.dra.{version}"
        assert module.DESCRIPTOR.package == package
        assert module.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == f"{package}.DRAPlugin"
        assert _methods(module, "DRAPlugin") == {
            "NodePrepareResources": (False, False),
            "NodeUnprepareResources": (False, False),
        }
        assert _fields(module.Claim) == {
            "namespace": (1, t_str),
            "uid": (2, t_str),
            "name": (3, t_str),
        }
        assert _fields(module.NodePrepareResourcesRequest) == {"claims": (1, t_msg)}
        assert _fields(module.NodeUnprepareResourcesRequest) == {"claims": (1, t_msg)}
        assert _fields(module.NodePrepareResourceResponse) == {
            "devices": (1, t_msg),
            "error": (2, t_str),
        }
        assert _fields(module.NodeUnprepareResourceResponse) == {"error": (1, t_str)}
        for msg in (module.NodePrepareResourcesResponse, module.NodeUnprepareResourcesResponse):
            claims = msg.DESCRIPTOR.fields_by_name["claims"]
            assert claims.number == 1 and claims.message_type.GetOptions().map_entry
    device = {
        "request_names": (1, t_str),
        "pool_name": (2, t_str),
        "device_name": (3, t_str),
        "cdi_device_ids": (4, t_str),
    }
    assert _fields(v1beta1.Device) == device
    # share_id came with consumable capacity (kubelet 1.35), as proto3 `optional`.
    assert _fields(v1.Device) == {**device, "share_id": (5, t_str)}
    assert v1.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence


def test_dra_health_wire_names() -> None:
    from deviceplugin._pb import dra_health_v1alpha1_pb2 as health

    assert health.DESCRIPTOR.package == "v1alpha1"
    svc = health.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    assert svc.full_name == "v1alpha1.DRAResourceHealth"
    assert _methods(health, "DRAResourceHealth") == {"NodeWatchResources": (False, True)}
    t_str, t_msg, t_int64, t_enum = 9, 11, 3, 14
    assert _fields(health.DeviceIdentifier) == {"pool_name": (1, t_str), "device_name": (2, t_str)}
    assert _fields(health.DeviceHealth) == {
        "device": (1, t_msg),
        "health": (2, t_enum),
        "last_updated_time": (3, t_int64),
        "health_check_timeout_seconds": (4, t_int64),
        "message": (5, t_str),
    }
    assert _fields(health.NodeWatchResourcesResponse) == {"devices": (1, t_msg)}
    assert dict(health.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
