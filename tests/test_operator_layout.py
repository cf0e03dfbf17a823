"""GPU Operator nodes (issue 30 item 1): the toolkit container writes only
`management.nvidia.com/gpu=all`, so the plugin generates per-GPU driver devices of its own
with the host's `nvidia-ctk cdi generate` and names them in both APIs' answers; a GPU whose
generation fails is not served and says why. The stand-in `nvidia-ctk` generates as the real
one does."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplugin.cdi import generated
from deviceplugin.cdi.generated import DriverSpecGenerator
from deviceplugin.cdi.registry import driver_devices, known_devices, resolve
from deviceplugin.config.settings import Config, parse
from deviceplugin.daemon.startup import node_plan, with_driver_devices
from deviceplugin.plan import build_plan
from deviceplugin.simulate.cdi import (
    DRIVER_KIND,
    MANAGEMENT_KIND,
    binary_paths,
    library_paths,
    write_driver_cdi_spec,
)
from deviceplugin.simulate.ctk import write_nvidia_ctk
from deviceplugin.simulate.specs import LAYOUT_GPU_OPERATOR, SimSpec, load_spec
from tests.conftest import MakePlugin
from tests.test_dra_prepare import Rig, claim, result

OPERATOR = "h200x2-operator"
ROOT = "/run/nvidia/driver"
TS = "nvidia.com/gpu-fraction"


def operator_config(spec_dir: Path, **cdi: Any) -> Config:
    return parse({"version": "v1", "cdi": {"driverRoot": ROOT, "specDirs": [str(spec_dir)], **cdi}})


def ctk(spec: SimSpec, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    binary = write_nvidia_ctk(spec, tmp / "nvidia-ctk")
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)


# ---- the stand-in nvidia-ctk -------------------------------------------------------------


def test_stand_in_generates_per_gpu_devices_as_the_toolkit_does(tmp_path: Path) -> None:
    spec = load_spec(OPERATOR)
    out = ctk(
        spec, tmp_path, "cdi", "generate", "--device-name-strategy=uuid",
        f"--driver-root={ROOT}", "--dev-root=/", "--nvidia-ctk-path", "/opt/tk/nvidia-ctk",
        "--vendor=example.com", "--class=gpu",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    body = yaml.safe_load(out.stdout)
    assert body["kind"] == "example.com/gpu"
    names = [d["name"] for d in body["devices"]]
    assert names == [g.uuid for g in spec.gpus] + ["all"]
    first = body["devices"][0]["containerEdits"]["deviceNodes"]
    assert first == [{"path": f"/dev/nvidia{spec.gpus[0].minor}"}]
    edits = body["containerEdits"]
    assert [m["hostPath"] for m in edits["mounts"]] == library_paths(spec) + binary_paths(spec)
    assert all(m["hostPath"].startswith(ROOT + "/usr/") for m in edits["mounts"])
    assert all(not m["containerPath"].startswith(ROOT) for m in edits["mounts"])
    assert {h["path"] for h in edits["hooks"]} == {"/opt/tk/nvidia-ctk"}
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    # By index, the real default, and into a file whose name says the format.
    out = ctk(spec, tmp_path, "cdi", "generate", f"--driver-root={ROOT}", "--dev-root=/",
              f"--output={tmp_path / 'spec.json'}")  # fmt: skip
    assert out.returncode == 0 and out.stdout == ""
    written = yaml.safe_load((tmp_path / "spec.json").read_text())
    assert [d["name"] for d in written["devices"]] == ["0", "1", "all"]
    assert written["kind"] == "nvidia.com/gpu"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--driver-root=/"], "libnvidia-ml.so.1 not found under driver root /"),
        # --dev-root defaults to the driver root, which holds no /dev on this node
        ([f"--driver-root={ROOT}"], f"failed to locate {ROOT}/dev/nvidiactl"),
        ([f"--driver-root={ROOT}", "--dev-root=/", "--device-name-strategy=serial"],
         "invalid device name strategy: serial"),
        ([f"--driver-root={ROOT}", "--dev-root=/", "--vendor=-bad"], "invalid CDI vendor name"),
        ([f"--driver-root={ROOT}", "--dev-root=/", "--format=toml"], "invalid output format"),
        (["--no-such-flag"], "flag provided but not defined: -no-such-flag"),
    ],
)  # fmt: skip
def test_stand_in_refuses_what_the_toolkit_refuses(
    tmp_path: Path, args: list[str], error: str
) -> None:
    out = ctk(load_spec(OPERATOR), tmp_path, "cdi", "generate", *args)
    assert out.returncode == 1
    assert error in out.stderr
    assert out.stdout == ""


def test_the_simulated_operator_node_has_only_the_management_spec(tmp_path: Path) -> None:
    write_driver_cdi_spec(load_spec(OPERATOR), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["management.nvidia.com-gpu.yaml"]
    assert known_devices([tmp_path]) == {f"{MANAGEMENT_KIND}=all"}
    assert driver_devices([tmp_path], DRIVER_KIND) == frozenset()


# ---- the plugin: generate where the toolkit's spec has no per-GPU device ----------------


def operator_node(tmp_path: Path) -> tuple[SimSpec, Path, DriverSpecGenerator]:
    spec = load_spec(OPERATOR)
    spec_dir, cdi_dir = tmp_path / "run-cdi", tmp_path / "cdi"
    cdi_dir.mkdir()
    write_driver_cdi_spec(spec, spec_dir)
    stand_in = write_nvidia_ctk(spec, tmp_path / "sim" / "nvidia-ctk")
    return spec, spec_dir, DriverSpecGenerator(cdi_dir, binary=str(stand_in))


def test_operator_gpus_are_served_with_a_generated_driver_device(tmp_path: Path) -> None:
    spec, spec_dir, generator = operator_node(tmp_path)
    config = operator_config(spec_dir)
    inv = spec.inventory()
    plan, toolkit = node_plan(inv, config, tmp_path / "mps", {}, simulated=True,
                              generator=generator)  # fmt: skip
    assert toolkit == frozenset()
    assert [gp.skipped for gp in plan.gpus] == [None, None]
    assert [gp.driver_device for gp in plan.gpus] == [
        f"{generated.KIND}={g.uuid}" for g in spec.gpus
    ]
    # What a container naming it gets, resolved as the runtime does from the plugin's dir.
    got = resolve([spec_dir, tmp_path / "cdi"], [plan.gpus[1].driver_device])
    assert {n["path"] for n in got.device_nodes} >= {f"/dev/nvidia{spec.gpus[1].minor}"}
    assert f"/dev/nvidia{spec.gpus[0].minor}" not in {n["path"] for n in got.device_nodes}
    assert {m["hostPath"] for m in got.mounts} == {*library_paths(spec), *binary_paths(spec)}
    assert got.env["NVIDIA_VISIBLE_DEVICES"] == "void"
    # Without the generator (the plugin before the fix) nothing is served.
    bare, _ = node_plan(inv, config, tmp_path / "mps", {}, simulated=True)
    assert all(gp.skipped and gp.skipped.startswith("no-driver-cdi-device") for gp in bare.gpus)


def test_a_host_toolkits_device_wins_and_nothing_is_generated(tmp_path: Path) -> None:
    spec = dataclasses.replace(load_spec(OPERATOR), layout="host")
    spec_dir = tmp_path / "etc-cdi"
    write_driver_cdi_spec(spec, spec_dir)
    generator = DriverSpecGenerator(tmp_path, binary="/nonexistent/nvidia-ctk")
    config = parse({"version": "v1", "cdi": {"specDirs": [str(spec_dir)]}})
    plan, _ = node_plan(spec.inventory(), config, tmp_path / "mps", {}, simulated=True,
                        generator=generator)  # fmt: skip
    assert [gp.driver_device for gp in plan.gpus] == [f"{DRIVER_KIND}={g.uuid}" for g in spec.gpus]
    assert generator.runs == 0


def test_a_failed_generation_serves_nothing_and_says_why(tmp_path: Path) -> None:
    spec, spec_dir, generator = operator_node(tmp_path)
    config = operator_config(spec_dir, driverRoot="/")  # the operator's root not configured
    plan, _ = node_plan(spec.inventory(), config, tmp_path / "mps", {}, simulated=True,
                        generator=generator)  # fmt: skip
    for gp in plan.gpus:
        assert not gp.advertised
        assert gp.skipped is not None
        assert gp.skipped.startswith("no-driver-cdi-device: nvidia.com/gpu=")
        assert f"generating {generated.KIND} failed: nvidia-ctk cdi generate exit 1" in gp.skipped
        assert "libnvidia-ml.so.1 not found under driver root /" in gp.skipped
    assert not (tmp_path / "cdi" / generated.SPEC_FILE).exists()


def test_generation_runs_again_only_when_the_driver_version_changes(tmp_path: Path) -> None:
    spec, spec_dir, generator = operator_node(tmp_path)
    config = operator_config(spec_dir)
    inv = spec.inventory()
    plan = build_plan(inv, config)
    for _ in range(2):
        _, missing = with_driver_devices(plan, config, frozenset(), inv, generator)
        assert missing == {}
    assert generator.runs == 1
    path = tmp_path / "cdi" / generated.SPEC_FILE
    path.unlink()  # a version change must write it again
    newer = dataclasses.replace(inv, node=dataclasses.replace(inv.node, driver_version="615.50.1"))
    _, missing = with_driver_devices(plan, config, frozenset(), newer, generator)
    assert missing == {} and generator.runs == 2 and path.exists()


# ---- both APIs name it ------------------------------------------------------------------


def test_dra_prepare_names_the_generated_device(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"cdi": {"driverRoot": ROOT, "specDirs": [str(tmp_path / "none")]}})
    # The rig's GPUs, on an operator node.
    base = load_spec("h200x8")
    gpus = tuple(
        dataclasses.replace(g, uuid=gp.uuid, minor=gp.gpu.minor)
        for g, gp in zip(base.gpus, rig.plan.gpus, strict=True)
    )
    spec = dataclasses.replace(base, gpus=gpus, layout=LAYOUT_GPU_OPERATOR)
    stand_in = write_nvidia_ctk(spec, tmp_path / "sim" / "nvidia-ctk")
    (tmp_path / "cdi").mkdir()
    generator = DriverSpecGenerator(tmp_path / "cdi", binary=str(stand_in))
    rig.plan, missing = with_driver_devices(
        rig.plan, rig.config, frozenset(), spec.inventory(), generator
    )
    assert missing == {}
    out = rig.prepare(claim("u1", result("gpu-0", "4Gi")), claim("u2", result("gpu-2", None)))
    assert out["u1"].devices[0].cdi_device_ids == (
        f"{generated.KIND}={rig.uuid(0)}",
        "gpu-fraction.dev/claim=u1-gpu-0-0",
    )
    assert out["u2"].devices[0].cdi_device_ids == (f"{generated.KIND}={rig.uuid(2)}",)
    got = resolve([tmp_path / "cdi"], list(out["u1"].devices[0].cdi_device_ids))
    assert f"/dev/nvidia{spec.gpus[0].minor}" in {n["path"] for n in got.device_nodes}
    assert got.env["NVIDIA_GPU_MEMORY_REQUEST"] == "4096"


def test_the_plugin_serves_an_operator_node_through_allocate(
    make_plugin: MakePlugin, short_tmp: Path
) -> None:
    config = f"version: v1\ncdi: {{driverRoot: {ROOT}}}\n"
    plugin = make_plugin(config, preset=OPERATOR)
    plugin.start()
    plugin.wait_registered(1)
    answer = plugin.kubelet.allocate(TS, 2)
    spec = load_spec(OPERATOR)
    gpu = spec.gpu(answer.annotations["gpu-fraction.dev/gpu"])
    names = [d.name for d in answer.cdi_devices]
    assert names[0] == f"{generated.KIND}={gpu.uuid}"
    got = resolve([plugin.cdi], names)
    assert f"/dev/nvidia{gpu.minor}" in {n["path"] for n in got.device_nodes}
    assert {m["hostPath"] for m in got.mounts} >= set(library_paths(spec))
    assert got.env["NVIDIA_GPU_MEMORY_LIMIT"] == "2048"
    assert "driver CDI spec generated" in plugin.log.read_text()


def test_inventory_says_why_an_operator_node_serves_nothing(tmp_path: Path) -> None:
    def inventory(*extra: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "deviceplugin", "inventory", "--simulate", OPERATOR, *extra],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "failed: nvidia-ctk cdi generate exit 1" in inventory()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"version: v1\ncdi: {{driverRoot: {ROOT}}}\n")
    served = inventory("--config", str(cfg))
    assert "no-driver-cdi-device" not in served
    assert " 139 " in served.splitlines()[2]
