"""The CDI merge of several devices in one container, as the CDI library applies edits
(container-device-interface `pkg/cdi/container-edits.go`, `ContainerEdits.Apply`): a variable
of the same name replaced where it stands, a mount at the same container path removed before
the new one is appended (even one the runtime made), a device node likewise, hooks appended.
What a container gets from two of our devices follows from it: the last device's values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deviceplugin.cdi import registry
from deviceplugin.simulate import pod


def spec(directory: Path, kind: str, devices: dict[str, dict[str, Any]]) -> None:
    body = {
        "cdiVersion": "0.6.0",
        "kind": kind,
        "devices": [{"name": n, "containerEdits": e} for n, e in devices.items()],
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{kind.replace('/', '_')}.json").write_text(json.dumps(body))


def share(n: int) -> dict[str, Any]:
    return {
        "env": [f"CUDA_MPS_PIPE_DIRECTORY=/mps/gpu{n}/pipe", f"NVIDIA_GPU_MEMORY_LIMIT={n}000"],
        "mounts": [
            {
                "hostPath": f"/mps/gpu{n}/shm",
                "containerPath": "/dev/shm",
                "options": ["rbind", "rw"],
            }
        ],
        "deviceNodes": [{"path": "/dev/nvidia-caps", "hostPath": f"/dev/caps{n}"}],
        "hooks": [{"hookName": "createRuntime", "path": "/bin/hook", "args": [str(n)]}],
    }


def test_the_device_applied_last_wins_a_variable_a_mount_and_a_node(tmp_path: Path) -> None:
    spec(tmp_path, "x.dev/share", {"a": share(1), "b": share(2)})
    got = registry.resolve([tmp_path], ["x.dev/share=a", "x.dev/share=b"])
    assert got.env == {
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/gpu2/pipe",
        "NVIDIA_GPU_MEMORY_LIMIT": "2000",
    }
    assert [(m["hostPath"], m["containerPath"]) for m in got.mounts] == [
        ("/mps/gpu2/shm", "/dev/shm")
    ]
    assert [n["hostPath"] for n in got.device_nodes] == ["/dev/caps2"]
    assert [h["args"] for h in got.hooks] == [["1"], ["2"]]  # hooks add up


def test_edits_replace_what_the_runtime_built_in_place(tmp_path: Path) -> None:
    spec(tmp_path, "x.dev/share", {"a": share(1)})
    built = registry.Resolved(
        env={"NVIDIA_GPU_MEMORY_LIMIT": "9", "HOME": "/root"},
        mounts=[
            {"hostPath": "shm", "containerPath": "/dev/shm"},
            {"hostPath": "/data", "containerPath": "/data"},
        ],
    )
    registry.resolve([tmp_path], ["x.dev/share=a"], built)
    assert list(built.env) == ["NVIDIA_GPU_MEMORY_LIMIT", "HOME", "CUDA_MPS_PIPE_DIRECTORY"]
    assert built.env["NVIDIA_GPU_MEMORY_LIMIT"] == "1000"
    assert [m["containerPath"] for m in built.mounts] == ["/data", "/dev/shm"]
    assert built.mounts[-1]["hostPath"] == "/mps/gpu1/shm"


def test_a_pod_view_of_two_of_our_devices_keeps_the_last_devices_values(tmp_path: Path) -> None:
    spec(tmp_path, "x.dev/share", {"a": share(1), "b": share(2)})
    answer = {
        "envs": {"NVIDIA_GPU_MEMORY_LIMIT": "5"},
        "mounts": [["/dev/shm", "/host/shm", False]],
        "cdi_devices": ["x.dev/share=a", "x.dev/share=b"],
    }
    view = pod.view_of(answer, [tmp_path])
    assert view.env["NVIDIA_GPU_MEMORY_LIMIT"] == "2000"
    assert view.mounts == [("/mps/gpu2/shm", "/dev/shm")]  # one /dev/shm: the last one
