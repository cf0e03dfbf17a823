"""The driver's CDI specs a simulated node has, as the NVIDIA container toolkit writes them.

Host layout: the toolkit's `nvidia-ctk cdi generate` spec, kind `nvidia.com/gpu`, one
device per GPU (by index and by UUID) plus `all`; the plugin's answers name those devices.
GPU Operator layout: only the toolkit container's management spec,
`management.nvidia.com/gpu=all` (gpu-operator's toolkit container writes it in management
mode, nvidia-container-toolkit `cmd/nvidia-ctk-installer/toolkit/toolkit.go`); no per-GPU
device exists, so the plugin must generate its own with the stand-in `nvidia-ctk` (`ctk`).
`driver_spec` builds the shape all three share: device nodes under the device root, driver
libraries and utility binaries under the driver root, the toolkit's ldcache hook.
`NVIDIA_SMI` is the stand-in `nvidia-smi` that the spec mounts: the runtime suites put it at
its host path (never on the real host's filesystem) and containers run it.
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
BIN_DIR = "/usr/bin"
# nvidia-container-toolkit `pkg/nvcdi/driver-nvml.go` `newDriverBinariesDiscoverer` mounts
# nvidia-smi, nvidia-debugdump, nvidia-persistenced, nvidia-cuda-mps-control/-server and
# nvidia-imex(-ctl), each only where the driver root has it (`internal/discover/mounts.go`
# skips what its locator misses). The simulated driver root holds one of them, nvidia-smi
# (the simulated MPS control runs on the host only, from the state dir).
BINARIES = ("nvidia-smi",)
# `internal/discover/mounts.go` `Mounts`: the options of every library and binary mount.
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")
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


def binary_paths(spec: SimSpec, driver_root: str | None = None) -> list[str]:
    """The simulated driver's utility binaries as host paths (under the driver root)."""
    root = spec.driver_root if driver_root is None else driver_root
    return [_under(root, f"{BIN_DIR}/{name}") for name in BINARIES]


def driver_spec(
    spec: SimSpec,
    kind: str,
    hook_path: str,
    devices: list[dict[str, Any]],
    driver_root: str | None = None,
    dev_root: str | None = None,
) -> dict[str, Any]:
    """A toolkit-shaped spec: `devices`, then the edits every device shares (control
    nodes, the driver libraries and binaries mounted at their in-container paths, that is
    their host paths less the driver root; the ldcache hook)."""
    root = spec.driver_root if driver_root is None else driver_root
    dev = spec.dev_root if dev_root is None else dev_root
    files = [(host, f"{LIB_DIR}/{Path(host).name}") for host in library_paths(spec, root)]
    files += [(host, f"{BIN_DIR}/{Path(host).name}") for host in binary_paths(spec, root)]
    mounts = [
        {"hostPath": host, "containerPath": ctr, "options": list(MOUNT_OPTIONS)}
        for host, ctr in files
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


# The stand-in `nvidia-smi` (POSIX sh: container images may hold nothing but busybox). It
# knows no GPU data, so it says only what the container can see: one line per GPU device
# node it can open, numbered from 0 as NVML numbers a container's visible GPUs. Exit codes
# as nvidia-smi(1) RETURN VALUE lists them: 2 a bad flag, 6 no device found, 9 no driver
# (no /dev/nvidiactl), 12 no NVML library (the spec mounts it into LIB_DIR).
NVIDIA_SMI = r"""#!/bin/sh
# stand-in nvidia-smi of the simulated driver: device nodes only, no GPU data
case "$*" in
  ""|-L|--list-gpus) ;;
  -h|--help) echo "stand-in nvidia-smi: answers no arguments and -L/--list-gpus"; exit 0 ;;
  *) echo "stand-in nvidia-smi: unsupported arguments: $*" >&2; exit 2 ;;
esac
if [ ! -c /dev/nvidiactl ]; then
  echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2
  exit 9
fi
nvml=""
for lib in LIBDIR/libnvidia-ml.so*; do [ -e "$lib" ] && nvml="$lib"; done
if [ -z "$nvml" ]; then
  echo "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system." >&2
  exit 12
fi
n=0
minor=0
while [ "$minor" -le 254 ]; do
  if [ -c "/dev/nvidia$minor" ]; then
    echo "GPU $n: NVIDIA stand-in (minor $minor)"
    n=$((n + 1))
  fi
  minor=$((minor + 1))
done
if [ "$n" -eq 0 ]; then
  echo "No devices were found" >&2
  exit 6
fi
""".replace("LIBDIR", LIB_DIR)
STAND_INS = {"nvidia-smi": NVIDIA_SMI}  # BINARIES' text, by name


def write_binaries(dest: Path) -> list[Path]:
    """Write each of BINARIES' stand-ins into `dest` (mode 0755), for a suite to put at the
    host paths the spec mounts."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for name in BINARIES:
        path = dest / name
        fsutil.atomic_write(path, STAND_INS[name].encode(), 0o755)
        out.append(path)
    return out
