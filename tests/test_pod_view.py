"""The hardware check's resolver and runner (DESIGN 9): an Allocate answer of the plugin's
own Allocator becomes a container's env, mounts and device nodes as a CDI runtime merges
them, and a client run with only that view reaches its MPS daemon. No GPU here: the script
is checked for syntax and its embedded helpers compile; it runs on a GPU machine later."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.cdi import registry as cdi_registry
from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.config.settings import Config
from deviceplugin.dpapi.allocator import Allocator, Grant
from deviceplugin.ledger.store import Ledger
from deviceplugin.mps import layout
from deviceplugin.mps.shm import ShmState
from deviceplugin.simulate import mps_client, pod
from tests.test_mps_supervisor import GPU_A, Rig, gpu_plan, rig_in, slice_plan, started

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "hack" / "gpu-smoke.sh"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")


@pytest.fixture
def rig(short_tmp: Path) -> Iterator[Rig]:
    with rig_in(short_tmp) as r:
        yield r


def driver_spec(spec_dir: Path, node: Path) -> None:
    """A toolkit-shaped spec for GPU_A: top-level `void`, the GPU's node (host file `node`)."""
    spec = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {
                "name": GPU_A,
                "containerEdits": {
                    "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": str(node)}]
                },
            }
        ],
        "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]},
    }
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "nvidia.json").write_text(json.dumps(spec))


def answer(grant: Grant) -> dict[str, Any]:
    return {
        "envs": grant.envs,
        "mounts": [list(m) for m in grant.mounts],
        "device_specs": [list(d) for d in grant.device_specs],
        "cdi_devices": grant.cdi_devices,
    }


def allocate(rig: Rig, strategies: tuple[str, ...] = ("cdi",)) -> tuple[Grant, Path]:
    sup = started(rig, shm={GPU_A: ShmState.DIRECTORY})
    plan = slice_plan(gpu_plan(GPU_A))
    config = Config(device_list_strategy=strategies, mps=rig.config.mps)
    cdi_dir = rig.root.parent / "cdi"
    allocator = Allocator(
        lambda: plan,
        lambda: config,
        cdi_dir,
        rig.root,
        Ledger(rig.root.parent / "state"),
        rig.board,
        mps=sup,
    )
    gp = plan.gpus[0]
    return allocator.allocate(gp.resource, [gp.device_ids[0]]), cdi_dir


def test_view_merges_the_answer_as_a_runtime_does(rig: Rig) -> None:
    node = rig.root.parent / "nvidia0"
    node.write_text("gpu")
    drivers = rig.root.parent / "etc-cdi"
    driver_spec(drivers, node)
    grant, cdi_dir = allocate(rig)
    view = pod.view_of(answer(grant), [drivers, cdi_dir])
    pipe = str(layout.pipe_dir(rig.root, GPU_A))
    assert view.env["NVIDIA_VISIBLE_DEVICES"] == "void"  # the driver's, never overridden by us
    assert view.env["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    assert (pipe, pipe) in view.mounts
    assert (str(layout.shm_dir(rig.root, GPU_A)), "/dev/shm") in view.mounts
    assert view.device_nodes == [(str(node), "/dev/nvidia0")]
    # A device in no spec fails the container, as the runtime would.
    with pytest.raises(cdi_registry.UnresolvableDevice):
        pod.view_of(answer(grant), [cdi_dir])


def test_view_of_a_plain_answer_keeps_envs_mounts_and_nodes(rig: Rig) -> None:
    grant, _ = allocate(rig, ("envvar", "device-nodes"))
    view = pod.view_of(answer(grant), [])
    assert view.env == grant.envs and view.env["NVIDIA_VISIBLE_DEVICES"] == GPU_A
    assert [(h, c) for c, h, _ in grant.mounts] == view.mounts
    assert ("/dev/nvidia0", "/dev/nvidia0") in view.device_nodes
    assert ("/dev/nvidiactl", "/dev/nvidiactl") in view.device_nodes


@needs_root
def test_a_client_with_only_the_answers_view_reaches_its_daemon(rig: Rig) -> None:
    node = rig.root.parent / "nvidia0"
    node.write_text("gpu")
    drivers = rig.root.parent / "etc-cdi"
    driver_spec(drivers, node)
    grant, cdi_dir = allocate(rig)
    view = pod.view_of(answer(grant), [drivers, cdi_dir])
    stage = rig.root.parent / "stage"
    stage.mkdir()
    check = (
        "import os, sys; from deviceplugin.simulate import mps_client as c; "
        "print(sorted(os.listdir('/dev'))); print(open('/dev/nvidia0').read()); "
        "sys.exit(c.run())"
    )
    env = {**pod.container_env(view), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        pod.container_argv(view, [sys.executable, "-c", check], stage),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # Only the OCI defaults, the answer's node, and a private shm/pts.
    assert set(eval(lines[0])) <= {
        "full", "null", "random", "tty", "urandom", "zero", "nvidia0", "shm", "pts",
    }  # fmt: skip
    assert lines[1] == "gpu"
    assert mps_client.OK in done.stdout
    # Nothing stayed mounted on this machine.
    assert str(stage) not in Path("/proc/self/mountinfo").read_text()


def test_pod_cli_prints_the_view(rig: Rig, tmp_path: Path) -> None:
    grant, cdi_dir = allocate(rig, ("envvar",))
    path = tmp_path / "answer.json"
    path.write_text(json.dumps(answer(grant)))
    done = subprocess.run(
        [sys.executable, "-m", "deviceplugin.simulate.pod", "--answer", str(path),
         "--stage", str(tmp_path), "--spec-dir", str(cdi_dir), "--print"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["env"]["CUDA_MPS_PIPE_DIRECTORY"] == str(layout.pipe_dir(rig.root, GPU_A))


def test_gpu_smoke_script_is_valid_bash_and_its_helpers_compile() -> None:
    subprocess.run(["bash", "-n", str(SMOKE)], check=True, timeout=30)
    text = SMOKE.read_text()
    helpers = re.findall(r"cat >\"\$1/(\w+\.py)\" <<'EOF'\n(.*?)\nEOF\n", text, re.S)
    assert {name for name, _ in helpers} == {"mps_client.py", "mps_smoke.py"}
    for name, body in helpers:
        compile(body, name, "exec")
    smoke = dict(helpers)["mps_smoke.py"]
    # It runs clients as pods, from the plugin's own Allocate answer, never touching modes.
    for needle in ("pod.view_of", "pod.container_argv", "allocator.allocate",
                   '"setComputeMode": False', "compute_modes=None"):  # fmt: skip
        assert needle in smoke, needle
    assert "unshare --mount --propagation private" in text


def test_cdi_spec_name_of_the_answer_is_ours(rig: Rig) -> None:
    grant, _ = allocate(rig)
    assert grant.cdi_devices[0] == f"nvidia.com/gpu={GPU_A}"
    assert grant.cdi_devices[1].startswith(cdi_specs.KIND + "=")


@needs_root
def test_a_device_node_missing_on_the_host_fails_the_container(tmp_path: Path) -> None:
    view = pod.PodView({}, [], [(str(tmp_path / "no-such-node"), "/dev/nvidia9")])
    stage = tmp_path / "stage"
    stage.mkdir()
    done = subprocess.run(
        pod.container_argv(view, ["true"], stage),
        env=pod.container_env(view),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 92 and "missing on the host" in done.stderr


@needs_root
def test_a_mount_source_missing_on_the_host_fails_the_container_and_creates_nothing(
    tmp_path: Path,
) -> None:
    """A bind from a path that is not there (the simulated driver's nvidia-smi, where no
    suite put a stand-in) fails as runc fails it; the mount point, which is created on this
    machine's own filesystem, must not be made up at the missing source's path."""
    missing = tmp_path / "usr" / "bin" / "nvidia-smi"
    view = pod.PodView({}, [(str(missing), str(missing))])
    stage = tmp_path / "stage"
    stage.mkdir()
    done = subprocess.run(
        pod.container_argv(view, ["true"], stage),
        env=pod.container_env(view),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 93 and f"mount source {missing} is missing" in done.stderr
    assert not missing.exists()
