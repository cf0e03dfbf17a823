"""The driver's utility binaries in the simulated toolkit's specs, and the stand-in
`nvidia-smi` they mount.

The real `nvidia-ctk cdi generate` mounts the driver's nvidia-smi (and its other utilities,
where present) into every container of every device, read-only from under the driver root
at its path less the root (nvidia-container-toolkit `pkg/nvcdi/driver-nvml.go`
`newDriverBinariesDiscoverer`, `internal/discover/mounts.go`). The stand-in runs in a
busybox root here, as in a container: it lists only the GPU device nodes it can see.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplugin.cdi.registry import resolve
from deviceplugin.simulate.cdi import (
    BIN_DIR,
    DRIVER_KIND,
    LIB_DIR,
    MANAGEMENT_KIND,
    build_driver_cdi_spec,
    build_management_cdi_spec,
    write_binaries,
    write_driver_cdi_spec,
)
from deviceplugin.simulate.ctk import write_nvidia_ctk
from deviceplugin.simulate.specs import OPERATOR_DRIVER_ROOT, load_spec
from tests.e2e.requirements import BUSYBOX

OPTIONS = ["ro", "nosuid", "nodev", "rbind", "rprivate"]  # the toolkit's, as for libraries
SMI = f"{BIN_DIR}/nvidia-smi"


def smi_mounts(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in body["containerEdits"]["mounts"] if m["containerPath"] == SMI]


def test_the_host_toolkit_spec_mounts_nvidia_smi_into_every_device(tmp_path: Path) -> None:
    spec = load_spec("mixed")
    body = build_driver_cdi_spec(spec)
    assert smi_mounts(body) == [{"hostPath": SMI, "containerPath": SMI, "options": OPTIONS}]
    # What a runtime applies for any one GPU's device: the spec-wide edits, so the binary.
    write_driver_cdi_spec(spec, tmp_path)
    for name in (spec.gpus[1].uuid, str(spec.gpus[2].index), "all"):
        got = resolve([tmp_path], [f"{DRIVER_KIND}={name}"])
        assert (SMI, SMI) in {(m["hostPath"], m["containerPath"]) for m in got.mounts}, name


def test_the_operator_specs_mount_nvidia_smi_from_the_driver_root(tmp_path: Path) -> None:
    spec = load_spec("h200x2-operator")
    host = f"{OPERATOR_DRIVER_ROOT}{SMI}"
    management = build_management_cdi_spec(spec)
    assert management["kind"] == MANAGEMENT_KIND
    assert smi_mounts(management) == [{"hostPath": host, "containerPath": SMI, "options": OPTIONS}]
    ctk = write_nvidia_ctk(spec, tmp_path / "nvidia-ctk")
    out = subprocess.run(
        [str(ctk), "cdi", "generate", f"--driver-root={OPERATOR_DRIVER_ROOT}", "--dev-root=/"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    generated = yaml.safe_load(out.stdout)
    assert smi_mounts(generated) == [{"hostPath": host, "containerPath": SMI, "options": OPTIONS}]


# ---- the stand-in nvidia-smi, run in a busybox root ---------------------------------------


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (chroot, device nodes)"
    if not shutil.which("chroot") or not BUSYBOX.is_file():
        return f"needs chroot and a static {BUSYBOX}"
    if b"ld-linux" in BUSYBOX.read_bytes()[:4096]:
        return f"{BUSYBOX} is dynamically linked"
    return None


needs_busybox_root = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


class Root:
    """A container-like root: busybox's sh, the stand-in at its path, the driver's NVML
    library and the device nodes it is given."""

    def __init__(self, path: Path) -> None:
        self.path = path
        (path / "bin").mkdir(parents=True)
        shutil.copy2(BUSYBOX, path / "bin" / "busybox")
        (path / "bin" / "sh").symlink_to("busybox")
        write_binaries(path / BIN_DIR.lstrip("/"))
        self.nvml = path / LIB_DIR.lstrip("/") / "libnvidia-ml.so.580.65.06"
        self.nvml.parent.mkdir(parents=True)
        self.nvml.write_text("stand-in driver library\n")
        (path / "dev").mkdir()

    def node(self, name: str, major: int, minor: int) -> Path:
        dev = self.path / "dev" / name
        os.mknod(dev, 0o600 | 0o020000, os.makedev(major, minor))  # S_IFCHR
        return dev

    def smi(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(shutil.which("chroot")), str(self.path), SMI, *args], capture_output=True,
            text=True, timeout=30, env={"PATH": "/bin"},
        )  # fmt: skip


@needs_busybox_root
def test_stand_in_lists_the_gpu_nodes_it_can_see_in_minor_order(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    root.node("nvidiactl", 195, 255)
    root.node("nvidia-uvm", 510, 0)  # not a GPU
    root.node("nvidia10", 195, 10)
    root.node("nvidia3", 195, 3)
    (root.path / "dev" / "nvidia4").write_text("")  # a file, not a device node
    lines = ["GPU 0: NVIDIA stand-in (minor 3)", "GPU 1: NVIDIA stand-in (minor 10)"]
    for args in (["-L"], ["--list-gpus"], []):
        out = root.smi(*args)
        assert (out.returncode, out.stdout.splitlines(), out.stderr) == (0, lines, ""), args


@needs_busybox_root
def test_stand_in_fails_as_nvidia_smi_does(tmp_path: Path) -> None:
    """nvidia-smi(1) RETURN VALUE: 2 a bad flag, 6 nothing found, 9 no driver, 12 no NVML."""
    root = Root(tmp_path / "root")
    ctl = root.node("nvidiactl", 195, 255)
    gpu = root.node("nvidia0", 195, 0)
    out = root.smi("-q")
    assert (out.returncode, out.stdout) == (2, "") and "-q" in out.stderr
    assert root.smi("-L", "-i", "0").returncode == 2
    root.nvml.unlink()
    assert root.smi("-L").returncode == 12
    root.nvml.write_text("stand-in driver library\n")
    gpu.unlink()
    out = root.smi("-L")
    assert (out.returncode, out.stdout, out.stderr) == (6, "", "No devices were found\n")
    ctl.unlink()
    root.node("nvidia0", 195, 0)
    out = root.smi()
    assert out.returncode == 9 and "driver" in out.stderr and out.stdout == ""
