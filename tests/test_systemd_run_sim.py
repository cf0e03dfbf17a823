"""The cluster node's stand-in `systemd-run` (deviceplugin/simulate/systemd_run.py): what it takes
from the command line HostSystemdLauncher builds, and what systemd does with it: the -E
environment only, a new session, the output in the journal, a cgroup of the unit's own, the
start done when the started process exits, an active unit's name refused, BindPaths= in a mount
namespace of the unit's own. Cgroups are fake directories, and real ones where we are root."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.mps import layout
from deviceplugin.mps.control import MpsControl
from deviceplugin.mps.launch import HostSystemdLauncher, unit_name
from deviceplugin.plumbing.process import pid_alive
from deviceplugin.simulate import mps_control as fake
from deviceplugin.simulate import systemd_run
from tests.test_mps_supervisor import GPU_A

STAND_IN = Path(systemd_run.__file__)
UNIT = "gpu-fraction-mps-test.service"
# The started process: records what it was given, forks a child that lives on (a daemon),
# exits with $EXIT (default 0). The child's pid goes to $0.
PROBE = r"""
import json, os, sys, time
out = sys.argv[1]
info = {"env": dict(os.environ), "pid": os.getpid(), "sid": os.getsid(0),
        "stdin": os.readlink("/proc/self/fd/0"), "cwd": os.getcwd()}
print("hello from the unit")
child = os.fork()
if child == 0:
    os.setsid()
    time.sleep(60)
    os._exit(0)
info["child"] = child
with open(out, "w") as f:
    json.dump(info, f)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def stand_in(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The stand-in as the node runs it: `python3 -I …/systemd_run.py`, stdlib only."""
    return subprocess.run(
        [sys.executable, "-I", str(STAND_IN), *args], capture_output=True, text=True,
        env=env, timeout=30,
    )  # fmt: skip


@pytest.fixture
def node(tmp_path: Path) -> dict[str, str]:
    """Fake cgroup hierarchies (two v1 controllers, cpuset with its cpus) and a state dir."""
    mounts = [tmp_path / "cg" / name for name in ("cpuset", "memory")]
    for m in mounts:
        m.mkdir(parents=True)
    (mounts[0] / "cpuset.cpus").write_text("0-1\n")
    (mounts[0] / "cpuset.mems").write_text("0\n")
    env = {
        "PATH": os.environ["PATH"],
        "CALLER_SECRET": "must-not-leak",
        "SYSTEMD_RUN_SIM_CGROUP_MOUNTS": ":".join(map(str, mounts)),
        "SYSTEMD_RUN_SIM_CGROUP_ROOT": "/node-root",
        "SYSTEMD_RUN_SIM_STATE": str(tmp_path / "state"),
    }
    return env


def launcher_args(probe: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"--unit={UNIT}", "--collect", "--quiet", "--property=Type=forking", *extra,
        "-E", "CUDA_VISIBLE_DEVICES=GPU-x", "--", sys.executable, str(probe), str(out),
    ]  # fmt: skip


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_unit_gets_only_its_environment_a_session_a_cgroup_and_the_journal(
    tmp_path: Path, node: dict[str, str]
) -> None:
    probe, out = tmp_path / "probe.py", tmp_path / "out.json"
    probe.write_text(PROBE)
    got = stand_in(launcher_args(probe, out), node)
    assert got.returncode == 0, got.stderr
    assert got.stdout == "" and got.stderr == "", "--quiet: nothing printed"
    info = json.loads(out.read_text())
    try:
        # systemd.exec(5): -E and the manager's own variables, nothing of the caller's
        env = info["env"]
        assert env["CUDA_VISIBLE_DEVICES"] == "GPU-x"
        assert env["PATH"] == systemd_run.SYSTEMD_PATH
        # (LC_CTYPE: Python's own C-locale coercion, in the probe itself)
        own = {"CUDA_VISIBLE_DEVICES", "PATH", "INVOCATION_ID", "SYSTEMD_EXEC_PID", "LC_CTYPE"}
        assert set(env) <= own, env
        assert info["sid"] == info["pid"], "not a session leader"
        assert info["stdin"] == "/dev/null" and info["cwd"] == "/"
        # the unit's cgroup in every hierarchy, under the node's root; cpuset filled in
        for mount in node["SYSTEMD_RUN_SIM_CGROUP_MOUNTS"].split(":"):
            procs = Path(mount) / "node-root" / "system.slice" / UNIT / "cgroup.procs"
            assert procs.read_text().split() == [str(info["pid"])], mount
        journal = Path(node["SYSTEMD_RUN_SIM_STATE"]) / f"{UNIT}.journal"
        assert "hello from the unit" in journal.read_text()
        assert pid_alive(info["child"]), "the forked daemon outlives the start"
    finally:
        kill(info["child"])


def test_a_failed_start_exits_1_quietly_and_a_collected_unit_can_start_again(
    tmp_path: Path, node: dict[str, str]
) -> None:
    probe, out = tmp_path / "probe.py", tmp_path / "out.json"
    probe.write_text(PROBE)
    args = launcher_args(probe, out)
    failing = [*args[:4], "-E", "EXIT=3", *args[4:]]
    got = stand_in(failing, node)
    kill(json.loads(out.read_text())["child"])
    assert (got.returncode, got.stdout, got.stderr) == (1, "", "")  # systemd-run: 1, not 3
    again = stand_in(args, node)
    kill(json.loads(out.read_text())["child"])
    assert again.returncode == 0, again.stderr  # --collect: the failed unit was unloaded
    # without --collect a failed unit stays loaded, and its name is refused
    loud = [a for a in failing if a not in ("--collect", "--quiet")]
    first = stand_in([a.replace(UNIT, "kept.service") for a in loud], node)
    kill(json.loads(out.read_text())["child"])
    assert first.returncode == 1 and "Job for kept.service failed" in first.stderr
    second = stand_in([a.replace(UNIT, "kept.service") for a in loud], node)
    assert second.returncode == 1 and "was already loaded" in second.stderr


def test_an_active_unit_is_refused_until_its_cgroup_is_empty(
    tmp_path: Path, node: dict[str, str]
) -> None:
    probe, out = tmp_path / "probe.py", tmp_path / "out.json"
    probe.write_text(PROBE)
    assert stand_in(launcher_args(probe, out), node).returncode == 0
    child = json.loads(out.read_text())["child"]
    # a fake hierarchy cannot inherit: put the daemon where a real cgroup would have it
    for mount in node["SYSTEMD_RUN_SIM_CGROUP_MOUNTS"].split(":"):
        (Path(mount) / "node-root" / "system.slice" / UNIT / "cgroup.procs").write_text(
            f"{child}\n"
        )
    try:
        got = stand_in(launcher_args(probe, out), node)
        assert got.returncode == 1
        assert got.stderr.strip() == systemd_run.EXISTS.format(UNIT)
    finally:
        kill(child)
    deadline = time.monotonic() + 5
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    got = stand_in(launcher_args(probe, out), node)
    kill(json.loads(out.read_text())["child"])
    assert got.returncode == 0, got.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--property=Type=simple"], "Type=simple"),
        (["--property=KillMode=none"], "Unknown assignment: KillMode=none"),
        (["--scope"], "unrecognized option '--scope'"),
        (["--property=BindPaths=relative"], "Failed to parse BindPaths="),
    ],
)
def test_what_the_launcher_never_sends_is_refused(
    tmp_path: Path, node: dict[str, str], args: list[str], message: str
) -> None:
    got = stand_in([f"--unit={UNIT}", *args, "--", "/bin/true"], node)
    assert got.returncode == 1 and message in got.stderr, got.stderr


def test_parse_takes_the_launchers_argv_whole(tmp_path: Path) -> None:
    ctl = MpsControl("nvidia-cuda-mps-control", tmp_path, GPU_A, base_env={})
    launcher = HostSystemdLauncher(host_binary="/opt/bin/mps-control")
    argv = launcher.launch(ctl.binary, ["-d"], ctl.mps_env(), {}, GPU_A, tmp_path / "shm").argv
    assert argv[:5] == ("nsenter", "-t", "1", "-m", "--") and argv[5] == "systemd-run"
    req = systemd_run.parse(argv[6:], {})
    assert req.unit == unit_name(GPU_A) and req.collect and req.quiet
    assert req.binds == [(str(tmp_path / "shm"), "/dev/shm")]
    assert req.env == ctl.mps_env()
    assert req.command == ["/opt/bin/mps-control", "-d"]
    # systemd-run(1): a bare name gets ".service"; -E NAME takes the caller's value
    bare = systemd_run.parse(["-u", "x", "-E", "HOME", "--", "/bin/true"], {"HOME": "/h"})
    assert bare.unit == "x.service" and bare.env == {"HOME": "/h"}


# --- as root: real cgroups and a real mount namespace -------------------------------------------


def _cgroup_mounts() -> list[Path]:
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    return [Path(r[4]) for r in rows if r[r.index("-") + 1] in ("cgroup", "cgroup2")]


@pytest.fixture
def real_node(tmp_path: Path) -> Iterator[dict[str, str]]:
    if os.geteuid() != 0 or not _cgroup_mounts():
        pytest.skip("needs root and mounted cgroups")
    root = f"gpu-fraction-systemd-run-test-{os.getpid()}"
    env = {
        "PATH": os.environ["PATH"],
        "SYSTEMD_RUN_SIM_CGROUP_ROOT": f"/{root}",
        "SYSTEMD_RUN_SIM_STATE": str(tmp_path / "state"),
    }
    try:
        yield env
    finally:
        for mount in _cgroup_mounts():
            top = mount / root
            if not top.is_dir():
                continue
            for procs in top.rglob("cgroup.procs"):
                for pid in procs.read_text().split():
                    kill(int(pid))
            deadline = time.monotonic() + 5
            for d in [*sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True), top]:
                while True:
                    try:
                        d.rmdir()
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)


def test_mps_daemon_through_the_stand_in_leaves_the_callers_cgroup_with_shm_bound(
    short_tmp: Path, real_node: dict[str, str]
) -> None:
    """HostSystemdLauncher's command (less nsenter) on the stand-in, the simulated control
    binary as the host's: the daemon runs in the unit's cgroups, not the caller's; its
    /dev/shm is the GPU's shm dir while ours is untouched; a second start is refused."""
    mps_root, shm = short_tmp / "mps", short_tmp / "shm"
    layout_dirs = [layout.pipe_dir(mps_root, GPU_A), layout.log_dir(mps_root, GPU_A)]
    for d in [*layout_dirs, shm]:
        d.mkdir(parents=True)
    binary = fake.write_launcher(short_tmp / "host-mps-control")
    ctl = MpsControl(str(binary), mps_root, GPU_A, base_env={})
    launch = HostSystemdLauncher(host_binary=str(binary)).launch(
        ctl.binary, ["-d"], ctl.mps_env(), {}, GPU_A, shm
    )
    got = stand_in(list(launch.argv[6:]), real_node)
    assert got.returncode == 0, got.stderr
    pid = int(layout.pid_file(mps_root, GPU_A).read_text())
    try:
        unit = f"{real_node['SYSTEMD_RUN_SIM_CGROUP_ROOT']}/system.slice/{unit_name(GPU_A)}"
        groups = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        assert groups and all(line.split(":", 2)[2] == unit for line in groups), groups
        assert list(shm.iterdir()), "the daemon's /dev/shm marker is not in the shm dir"
        ours = {p.name for p in Path("/dev/shm").iterdir()}
        assert not ours & {q.name for q in shm.iterdir()}, "the bind leaked into our /dev/shm"
        again = stand_in(list(launch.argv[6:]), real_node)
        assert again.returncode == 1
        assert again.stderr.strip() == systemd_run.EXISTS.format(unit_name(GPU_A))
        assert ctl.command("get_server_list", timeout=5) is not None
    finally:
        kill(pid)
