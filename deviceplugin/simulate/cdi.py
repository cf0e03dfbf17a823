"""The driver's CDI spec a simulated node has, as `nvidia-ctk cdi generate` writes it.

On a real node the NVIDIA container toolkit writes kind `nvidia.com/gpu` with one device per
GPU (by index and by UUID) plus `all`; the plugin's answers name those devices. Simulation
writes the same shape from the spec, so the same names resolve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from deviceplugin.plumbing import fsutil
from deviceplugin.simulate.specs import SimGpu, SimSpec

DRIVER_KIND = "nvidia.com/gpu"
SPEC_FILE = "nvidia.yaml"  # nvidia-ctk's default output name in /var/run/cdi
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
# A few of the driver libraries the toolkit mounts; enough to make the spec's shape real.
_LIBRARIES = ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so")


def _gpu_edits(gpu: SimGpu) -> dict[str, Any]:
    return {"deviceNodes": [{"path": f"/dev/nvidia{gpu.minor}"}]}


def build_driver_cdi_spec(
    spec: SimSpec, kind: str = DRIVER_KIND, nvidia_ctk_path: str = "/usr/bin/nvidia-ctk"
) -> dict[str, Any]:
    """The spec as a mapping: per-GPU devices by index and UUID, `all`, shared edits."""
    devices: list[dict[str, Any]] = []
    for g in spec.gpus:
        devices.append({"name": str(g.index), "containerEdits": _gpu_edits(g)})
        devices.append({"name": g.uuid, "containerEdits": _gpu_edits(g)})
    devices.append(
        {
            "name": "all",
            "containerEdits": {
                "deviceNodes": [{"path": f"/dev/nvidia{g.minor}"} for g in spec.gpus]
            },
        }
    )
    lib_dir = "/usr/lib/x86_64-linux-gnu"
    version = spec.driver_version
    mounts = [
        {
            "hostPath": f"{lib_dir}/{lib}.{version}",
            "containerPath": f"{lib_dir}/{lib}.{version}",
            "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
        }
        for lib in _LIBRARIES
    ]
    return {
        "cdiVersion": "0.5.0",  # device names starting with a digit need 0.5.0
        "kind": kind,
        "devices": devices,
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": p} for p in CONTROL_NODES],
            "mounts": mounts,
            "hooks": [
                {
                    "hookName": "createContainer",
                    "path": nvidia_ctk_path,
                    "args": ["nvidia-ctk", "hook", "update-ldcache", "--folder", lib_dir],
                }
            ],
        },
    }


def write_driver_cdi_spec(
    spec: SimSpec,
    cdi_dir: Path,
    kind: str = DRIVER_KIND,
    nvidia_ctk_path: str = "/usr/bin/nvidia-ctk",
) -> Path:
    """Write the simulated driver spec into `cdi_dir` atomically (mode 0644); returns its path."""
    cdi_dir.mkdir(parents=True, exist_ok=True)
    path = cdi_dir / SPEC_FILE
    body = build_driver_cdi_spec(spec, kind, nvidia_ctk_path)
    fsutil.atomic_write(path, yaml.safe_dump(body, sort_keys=False).encode(), 0o644)
    return path


def write_nvidia_ctk(spec: SimSpec, path: Path) -> Path:
    """A stand-in for the node's `nvidia-ctk` as strict as the real one: it answers
    `hook apply-cuda-memory-limits --help` only from toolkit 1.20.1 on (older toolkits
    say there is no such command and exit non-zero); other hooks succeed doing nothing."""
    hook = "0" if spec.memory_limits_hook else "3"
    script = f"""#!/bin/sh
# simulated nvidia-ctk, NVIDIA Container Toolkit {spec.toolkit_version}
case "$1 $2" in
  "--version "*) echo "NVIDIA Container Toolkit CLI version {spec.toolkit_version}"; exit 0 ;;
  "hook apply-cuda-memory-limits")
    if [ {hook} -ne 0 ]; then
      echo "No help topic for 'apply-cuda-memory-limits'" >&2; exit {hook}
    fi
    case " $* " in *" --help "*) echo "apply CUDA memory limits to a container" ;; esac
    exit 0 ;;
  "hook "*) exit 0 ;;
esac
echo "nvidia-ctk: unsupported in simulation: $*" >&2
exit 1
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    fsutil.atomic_write(path, script.encode(), 0o755)
    return path
