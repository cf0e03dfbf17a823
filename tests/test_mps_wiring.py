"""An MPS client sees its daemon's world (DESIGN 3b): the pipe dir at the daemon's own path
string and the GPU's shm dir as /dev/shm. The simulated client runs as a container would,
in new mount and IPC namespaces with a private /dev/shm and only the answer's env and
mounts, against a daemon the supervisor started; a wrong wiring fails it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin import caps
from deviceplugin.caps import Ceiling
from deviceplugin.config.settings import Config
from deviceplugin.model import GIB, GpuUuid
from deviceplugin.mps import layout, shm
from deviceplugin.mps.shm import ShmState
from deviceplugin.plan import SlicePlan, skip_gpus
from deviceplugin.simulate import mps_client, mps_daemon, pod
from deviceplugin.simulate import mps_control as fake
from tests.test_mps_supervisor import (
    GPU_A,
    GPU_B,
    Rig,
    gpu_plan,
    rig_in,
    slice_plan,
    started,
)


@pytest.fixture
def rig(short_tmp: Path) -> Iterator[Rig]:
    with rig_in(short_tmp) as r:
        yield r


ROOT = Path(__file__).resolve().parent.parent
OLD_PIPE = "/run/gpu-fraction/mps-pipe"  # the fixed container path the plugin used to give

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")


def edits(rig: Rig, gpu: GpuUuid = GPU_A) -> caps.ContainerEdits:
    gp = gpu_plan(gpu)
    return caps.fractional_edits(Config(), gp, rig.root, GIB, Ceiling(GIB, None, None), None)


def run_client(
    env: dict[str, str], mounts: list[tuple[str, str, bool]], hold: float = 0.0
) -> subprocess.CompletedProcess[str]:
    """The simulated client with only `env` and `mounts` (container path, host path, ro)."""
    argv = [sys.executable, "-m", "deviceplugin.simulate.mps_client", "--hold", str(hold)]
    view = pod.PodView(env, [(host, ctr) for ctr, host, _ in mounts])
    with tempfile.TemporaryDirectory(dir="/tmp") as stage:
        return subprocess.run(
            pod.container_argv(view, argv, Path(stage)),
            env={**pod.container_env(view), "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )


@needs_root
def test_client_wired_like_the_daemon_connects(rig: Rig) -> None:
    started(rig, shm={GPU_A: ShmState.DIRECTORY})
    got = edits(rig)
    pipe = str(layout.pipe_dir(rig.root, GPU_A))
    assert got.env["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    assert (pipe, pipe, True) in got.mounts
    assert ("/dev/shm", str(layout.shm_dir(rig.root, GPU_A)), False) in got.mounts
    done = run_client(got.env, got.mounts)
    assert done.returncode == 0, done.stderr
    assert mps_client.OK in done.stdout
    # The daemon's marker is in the GPU's shm dir, not in the host's /dev/shm.
    pid = rig.pid()
    assert (layout.shm_dir(rig.root, GPU_A) / f"{mps_daemon.SHM_PREFIX}{pid}").exists()
    assert not (Path("/dev/shm") / f"{mps_daemon.SHM_PREFIX}{pid}").exists()
    log = (layout.log_dir(rig.root, GPU_A) / mps_daemon.SERVER_LOG).read_text()
    assert "New client" in log and "disconnected" in log


@needs_root
def test_the_old_fixed_pipe_path_fails(rig: Rig) -> None:
    started(rig, shm={GPU_A: ShmState.DIRECTORY})
    got = edits(rig)
    host_pipe = str(layout.pipe_dir(rig.root, GPU_A))
    env = {**got.env, "CUDA_MPS_PIPE_DIRECTORY": OLD_PIPE}
    mounts = [(OLD_PIPE, host_pipe, True)] + [m for m in got.mounts if m[0] == "/dev/shm"]
    done = run_client(env, mounts)
    assert done.returncode == mps_client.WRONG_PIPE, done.stderr
    assert "pipe directory" in done.stderr


@needs_root
def test_a_missing_shm_mount_fails(rig: Rig) -> None:
    started(rig, shm={GPU_A: ShmState.DIRECTORY})
    got = edits(rig)
    done = run_client(got.env, [m for m in got.mounts if m[0] != "/dev/shm"])
    assert done.returncode == mps_client.NO_SHM, done.stderr


@needs_root
def test_a_daemon_on_the_host_shm_is_unreachable_for_clients(rig: Rig) -> None:
    # What the direct launcher did before: the daemon kept the plugin's /dev/shm.
    started(rig, shm={GPU_A: ShmState.HOST})
    got = edits(rig)
    try:
        done = run_client(got.env, got.mounts)
        assert done.returncode == mps_client.NO_SHM, done.stderr
    finally:
        (Path("/dev/shm") / f"{mps_daemon.SHM_PREFIX}{rig.pid()}").unlink(missing_ok=True)


@needs_root
def test_two_clients_on_one_gpu_at_once(rig: Rig) -> None:
    started(rig, shm={GPU_A: ShmState.DIRECTORY})
    got = edits(rig)
    argv = [sys.executable, "-m", "deviceplugin.simulate.mps_client", "--hold", "3"]
    view = pod.PodView(got.env, [(host, ctr) for ctr, host, _ in got.mounts])
    env = {**pod.container_env(view), "PYTHONPATH": str(ROOT)}
    stages = [rig.root.parent / f"stage{n}" for n in range(2)]
    for stage in stages:
        stage.mkdir()
    procs = [
        subprocess.Popen(
            pod.container_argv(view, argv, stage),
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for stage in stages
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    log = (layout.log_dir(rig.root, GPU_A) / mps_daemon.SERVER_LOG).read_text()
    assert log.count("New client") == 2


@needs_root
def test_a_faulted_server_refuses_the_client(rig: Rig) -> None:
    started(rig, shm={GPU_A: ShmState.DIRECTORY})
    fake.inject_fault(layout.pipe_dir(rig.root, GPU_A))
    got = edits(rig)
    done = run_client(got.env, got.mounts)
    assert done.returncode == mps_client.SERVER_NOT_READY, done.stderr


SHM_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from deviceplugin.mps import layout, shm
    root, uuid = Path(sys.argv[1]), sys.argv[2]
    first = shm.ensure(root, uuid, 64 << 20, simulated=False)
    again = shm.ensure(root, uuid, 64 << 20, simulated=False)
    path = layout.shm_dir(root, uuid)
    st = os.statvfs(path)
    print(first[0].value, again[0].value, os.path.ismount(path), st.f_blocks * st.f_frsize,
          oct(path.stat().st_mode & 0o7777))
    """
)


@needs_root
def test_a_node_mounts_a_tmpfs_of_shm_size_once(short_tmp: Path) -> None:
    # In a private mount namespace, so nothing is left mounted on this machine.
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-c",
         SHM_SCRIPT, str(short_tmp / "mps"), GPU_A],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, again, mounted, size, mode = done.stdout.split()
    assert (first, again, mounted) == ("tmpfs", "tmpfs", "True")
    assert int(size) == 64 << 20
    assert mode == "0o1777"


def test_a_node_that_cannot_mount_skips_the_gpu(short_tmp: Path) -> None:
    def refuse(path: Path, size: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    state, why = shm.ensure(short_tmp, GPU_A, GIB, simulated=False, mounter=refuse)
    assert state is ShmState.UNAVAILABLE and "not permitted" in why
    plan = skip_gpus(slice_plan(gpu_plan(GPU_A), gpu_plan(GPU_B)), {GPU_A: shm.SKIP_REASON})
    a, b = plan.for_gpu(GPU_A), plan.for_gpu(GPU_B)
    assert a is not None and not a.advertised and a.skipped == "mps-shm-unavailable"
    assert b is not None and b.advertised
    assert plan.resources == (b.resource,)


def test_simulation_never_mounts_and_says_what_the_daemon_gets(short_tmp: Path) -> None:
    def boom(path: Path, size: int) -> None:
        raise AssertionError("a simulation must not mount on the host")

    root_state, _ = shm.ensure(
        short_tmp, GPU_A, GIB, simulated=True, mounter=boom, privileged=lambda: True
    )
    user_state, why = shm.ensure(
        short_tmp, GPU_B, GIB, simulated=True, mounter=boom, privileged=lambda: False
    )
    assert root_state is ShmState.DIRECTORY and root_state.bound
    assert user_state is ShmState.HOST and not user_state.bound
    assert "host /dev/shm" in why
    assert layout.shm_dir(short_tmp, GPU_A).is_dir()


def test_inventory_says_what_the_daemons_dev_shm_is(monkeypatch: pytest.MonkeyPatch) -> None:
    from deviceplugin import cli
    from deviceplugin.mps import shm as shm_mod

    plan = slice_plan(gpu_plan(GPU_A))
    monkeypatch.setattr(shm_mod, "may_mount", lambda: False)
    assert "host-shm" in (cli._mps_shm_note(plan, simulated=True) or "")
    monkeypatch.setattr(shm_mod, "may_mount", lambda: True)
    assert "directory" in (cli._mps_shm_note(plan, simulated=True) or "")
    assert "tmpfs" in (cli._mps_shm_note(plan, simulated=False) or "")
    from deviceplugin.model import Mode

    assert cli._mps_shm_note(slice_plan(gpu_plan(GPU_A, Mode.TIME_SLICING)), True) is None


def _with_mps_shm(
    root: Path, plan: SlicePlan, simulated: bool
) -> tuple[SlicePlan, dict[GpuUuid, ShmState]]:
    """What the daemon's node plan does with `plan` at startup: the plan and each GPU's shm
    state."""
    from deviceplugin.daemon.startup import with_mps_shm

    states: dict[GpuUuid, ShmState] = {}
    return with_mps_shm(plan, Config(), root / "mps", states, simulated=simulated), states


def test_a_node_that_cannot_mount_the_shm_does_not_advertise_the_gpu(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(path: Path, size: int) -> None:
        raise PermissionError(1, f"mount tmpfs at {path}: Operation not permitted")

    monkeypatch.setattr(shm, "mount_tmpfs", refuse)
    plan = slice_plan(gpu_plan(GPU_A), gpu_plan(GPU_B))
    with caplog.at_level(logging.WARNING, logger="gpu-fraction.daemon"):
        got, states = _with_mps_shm(short_tmp, plan, simulated=False)
    for gpu in (GPU_A, GPU_B):
        gp = got.for_gpu(gpu)
        assert gp is not None and gp.skipped == "mps-shm-unavailable" and not gp.advertised
    assert got.resources == ()
    assert states == {GPU_A: ShmState.UNAVAILABLE, GPU_B: ShmState.UNAVAILABLE}
    assert any(r.kv.get("state") == "unavailable" for r in caplog.records)  # type: ignore[attr-defined]


def test_a_simulation_keeps_advertising_and_logs_the_host_shm(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shm, "may_mount", lambda: False)
    plan = slice_plan(gpu_plan(GPU_A))
    with caplog.at_level(logging.WARNING, logger="gpu-fraction.daemon"):
        got, states = _with_mps_shm(short_tmp, plan, simulated=True)
    assert got.for_gpu(GPU_A) == plan.for_gpu(GPU_A)
    assert states == {GPU_A: ShmState.HOST}
    logged = [r for r in caplog.records if r.getMessage() == "mps shm"]
    assert logged and logged[0].kv["state"] == "host-shm"  # type: ignore[attr-defined]
