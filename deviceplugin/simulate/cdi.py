"""The driver's CDI specs a simulated node has, as the NVIDIA container toolkit writes them.

Host layout: the toolkit's `nvidia-ctk cdi generate` spec, kind `nvidia.com/gpu`, one
device per GPU (by index and by UUID) plus `all`; the plugin's answers name those devices.
GPU Operator layout: only the toolkit container's management spec,
`management.nvidia.com/gpu=all` (gpu-operator's toolkit container writes it in management
mode, nvidia-container-toolkit `cmd/nvidia-ctk-installer/toolkit/toolkit.go`); no per-GPU
device exists, so the plugin must generate its own with the stand-in `nvidia-ctk` (`ctk`).
`driver_spec` builds the shape all three share: device nodes under the device root, driver
libraries under the driver root, the toolkit's ldcache hook.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from deviceplugin.plumbing import fsutil
from deviceplugin.simulate.specs import LAYOUT_GPU_OPERATOR, SimGpu, SimSpec

DRIVER_KIND = "nvidia.com/gpu"
SPEC_FILE = "nvidia.yaml"  # nvidia-ctk's default output name in /var/run/cdi
MANAGEMENT_KIND = "management.nvidia.com/gpu"
MANAGEMENT_SPEC_FILE = "management.nvidia.com-gpu.yaml"  # the operator's toolkit container's
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
LIB_DIR = "/usr/lib/x86_64-linux-gnu"
# A few of the driver libraries the toolkit mounts; enough to make the spec's shape real.
_LIBRARIES = ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so")
CDI_VERSION = "0.5.0"  # device names starting with a digit need 0.5.0


def _under(root: str, path: str) -> str:
    return path if root.rstrip("/") == "" else root.rstrip("/") + path


def device_node(path: str, dev_root: str) -> dict[str, Any]:
    """A device node as the toolkit writes it: `hostPath` only where /dev is elsewhere."""
    node = {"path": path}
    if dev_root.rstrip("/"):
        node["hostPath"] = _under(dev_root, path)
    return node


def library_paths(spec: SimSpec, driver_root: str | None = None) -> list[str]:
    """The simulated driver's libraries as host paths (under the driver root)."""
    root = spec.driver_root if driver_root is None else driver_root
    return [_under(root, f"{LIB_DIR}/{lib}.{spec.driver_version}") for lib in _LIBRARIES]


def driver_spec(
    spec: SimSpec,
    kind: str,
    hook_path: str,
    devices: list[dict[str, Any]],
    driver_root: str | None = None,
    dev_root: str | None = None,
) -> dict[str, Any]:
    """A toolkit-shaped spec: `devices`, then the edits every device shares (control
    nodes, the driver libraries mounted at their in-container paths, the ldcache hook)."""
    root = spec.driver_root if driver_root is None else driver_root
    dev = spec.dev_root if dev_root is None else dev_root
    mounts = [
        {
            "hostPath": host,
            "containerPath": f"{LIB_DIR}/{Path(host).name}",
            "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
        }
        for host in library_paths(spec, root)
    ]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind,
        "devices": devices,
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [device_node(p, dev) for p in CONTROL_NODES],
            "mounts": mounts,
            "hooks": [
                {
                    "hookName": "createContainer",
                    "path": hook_path,
                    "args": ["nvidia-ctk", "hook", "update-ldcache", "--folder", LIB_DIR],
                }
            ],
        },
    }


def gpu_devices(
    spec: SimSpec, names: Callable[[SimGpu], list[str]], dev_root: str | None = None
) -> list[dict[str, Any]]:
    """One device per name `names` gives each GPU (its node), plus `all`."""
    dev = spec.dev_root if dev_root is None else dev_root

    def node(g: SimGpu) -> dict[str, Any]:
        return device_node(f"/dev/nvidia{g.minor}", dev)

    devices = [
        {"name": name, "containerEdits": {"deviceNodes": [node(g)]}}
        for g in spec.gpus
        for name in names(g)
    ]
    every = [node(g) for g in spec.gpus]
    return [*devices, {"name": "all", "containerEdits": {"deviceNodes": every}}]


def build_driver_cdi_spec(
    spec: SimSpec, kind: str = DRIVER_KIND, nvidia_ctk_path: str = "/usr/bin/nvidia-ctk"
) -> dict[str, Any]:
    """The host toolkit's spec: per-GPU devices by index and UUID, `all`, shared edits."""
    devices = gpu_devices(spec, lambda g: [str(g.index), g.uuid])
    return driver_spec(spec, kind, nvidia_ctk_path, devices)


def build_management_cdi_spec(
    spec: SimSpec, nvidia_ctk_path: str = "/usr/bin/nvidia-ctk"
) -> dict[str, Any]:
    """The GPU Operator toolkit container's spec: one device, `all`, for the operator's own
    pods; nothing per GPU."""
    every = gpu_devices(spec, lambda g: [])
    return driver_spec(spec, MANAGEMENT_KIND, nvidia_ctk_path, every)


def write_driver_cdi_spec(
    spec: SimSpec,
    cdi_dir: Path,
    kind: str = DRIVER_KIND,
    nvidia_ctk_path: str = "/usr/bin/nvidia-ctk",
) -> Path:
    """Write the simulated node's driver spec into `cdi_dir` atomically (mode 0644): the
    toolkit's per-GPU spec, or on the GPU Operator layout the management spec only."""
    cdi_dir.mkdir(parents=True, exist_ok=True)
    if spec.layout == LAYOUT_GPU_OPERATOR:
        path = cdi_dir / MANAGEMENT_SPEC_FILE
        body = build_management_cdi_spec(spec, nvidia_ctk_path)
    else:
        path = cdi_dir / SPEC_FILE
        body = build_driver_cdi_spec(spec, kind, nvidia_ctk_path)
    fsutil.atomic_write(path, yaml.safe_dump(body, sort_keys=False).encode(), 0o644)
    return path
