"""MPS launchers: the exact host-systemd command, unit names, the config key, and a supervisor
starting, probing and adopting a daemon through fake `nsenter`/`systemd-run` executables that
record their argv and exec the rest, so the simulated control binary really runs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.config.settings import Config, ConfigError, MpsConfig, parse
from deviceplugin.health.board import HealthBoard
from deviceplugin.model import FaultDomain, GpuUuid
from deviceplugin.mps import launch, layout
from deviceplugin.mps.control import ControlError, MpsControl
from deviceplugin.mps.launch import DirectLauncher, HostSystemdLauncher, LaunchError, unit_name
from deviceplugin.mps.shm import ShmState
from deviceplugin.mps.supervisor import DaemonState, MpsSupervisor
from deviceplugin.plumbing.process import pid_alive
from deviceplugin.simulate import mps_control as fake
from deviceplugin.simulate import mps_daemon
from tests.test_mps_supervisor import (
    FAST,
    GPU_A,
    GPU_B,
    RecordingModes,
    gpu_plan,
    kill_everything,
    slice_plan,
    wait_until,
)

MIG = GpuUuid("MIG-0f1e2d3c-4b5a-6978-8091-a2b3c4d5e6f7")
MPS_VARS = {"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_VISIBLE_DEVICES"}
# systemd's unit name rules: this alphabet, a type suffix, at most 255 bytes.
UNIT_RE = re.compile(r"^[A-Za-z0-9:_.\\-]+\.service$")


# --- the command ---------------------------------------------------------------------------


def test_host_systemd_builds_the_exact_argv(tmp_path: Path) -> None:
    ctl = MpsControl("nvidia-cuda-mps-control", tmp_path, GPU_A, base_env={"PATH": "/bin"})
    launcher = HostSystemdLauncher(host_binary="/usr/bin/nvidia-cuda-mps-control")
    got = launcher.launch(ctl.binary, ["-d", "-p", "3"], ctl.mps_env(), {"PATH": "/bin"}, GPU_A)
    pipe, logs = layout.pipe_dir(tmp_path, GPU_A), layout.log_dir(tmp_path, GPU_A)
    assert got.argv == (
        "nsenter",
        "-t",
        "1",
        "-m",
        "--",
        "systemd-run",
        f"--unit=gpu-fraction-mps-{GPU_A}.service",
        "--collect",
        "--quiet",
        "--property=Type=forking",
        "-E",
        f"CUDA_MPS_LOG_DIRECTORY={logs}",
        "-E",
        f"CUDA_MPS_PIPE_DIRECTORY={pipe}",
        "-E",
        f"CUDA_VISIBLE_DEVICES={GPU_A}",
        "--",
        "/usr/bin/nvidia-cuda-mps-control",
        "-d",
        "-p",
        "3",
    )
    # The tools run with the plugin's environment; the daemon's variables travel only as -E.
    assert got.env == {"PATH": "/bin"}


def test_host_systemd_without_host_binary_uses_the_control_binary(tmp_path: Path) -> None:
    got = HostSystemdLauncher().launch(
        "/opt/nvidia/nvidia-cuda-mps-control", ["-d"], {"A": "1"}, {}, GPU_B
    )
    after = got.argv[got.argv.index("--", 5) + 1 :]
    assert after == ("/opt/nvidia/nvidia-cuda-mps-control", "-d")
    assert f"--unit=gpu-fraction-mps-{GPU_B}.service" in got.argv


def test_direct_launcher_is_the_binary_with_its_env(tmp_path: Path) -> None:
    ctl = MpsControl("/x/mps-control", tmp_path, GPU_A, base_env={"PATH": "/bin", "K": "v"})
    got = DirectLauncher().launch(ctl.binary, ["-d"], ctl.mps_env(), {"PATH": "/bin"}, GPU_A)
    assert got.argv == ("/x/mps-control", "-d")
    assert got.env == {"PATH": "/bin", **ctl.mps_env()}
    assert set(ctl.mps_env()) == MPS_VARS
    assert ctl.env() == {"PATH": "/bin", "K": "v", **ctl.mps_env()}


def test_unit_names_valid_stable_and_unique_per_gpu() -> None:
    names = [unit_name(g) for g in (GPU_A, GPU_B, MIG)]
    assert len(set(names)) == 3
    for name in names:
        assert UNIT_RE.match(name) and len(name) <= 255, name
        assert name.startswith("gpu-fraction-mps-")
    assert unit_name(GPU_A) == unit_name(str(GPU_A))


@pytest.mark.parametrize("bad", ["GPU-a b", "../etc", "GPU-" + "a" * 300, "GPU-x/y"])
def test_unit_name_refuses_what_is_not_a_uuid(bad: str) -> None:
    with pytest.raises(LaunchError):
        unit_name(bad)


def test_from_config_picks_the_launcher() -> None:
    assert Config().mps.launcher == "direct"
    assert isinstance(launch.from_config(Config().mps), DirectLauncher)
    host = launch.from_config(MpsConfig(launcher="host-systemd", host_binary="/h/bin"))
    assert isinstance(host, HostSystemdLauncher)
    assert host.host_binary == "/h/bin"


# --- the config key ------------------------------------------------------------------------


def test_config_keys_parse() -> None:
    mps = parse({"version": "v1", "mps": {"launcher": "host-systemd", "hostBinary": "/h/m"}}).mps
    assert (mps.launcher, mps.host_binary) == ("host-systemd", "/h/m")
    assert parse({"version": "v1"}).mps == MpsConfig()


@pytest.mark.parametrize(
    ("mps", "message"),
    [
        ({"launcher": "systemd"}, "mps.launcher: must be one of direct, host-systemd"),
        ({"launcher": True}, "mps.launcher: must be one of direct, host-systemd"),
        ({"hostBinary": ""}, "mps.hostBinary: must be a non-empty string"),
        ({"hostBinary": 3}, "mps.hostBinary: must be a non-empty string"),
    ],
)
def test_config_keys_refused_by_field(mps: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse({"version": "v1", "mps": mps})
    assert info.value.problems == [message]


# --- fake host tools -----------------------------------------------------------------------

NSENTER = """\
import json, os, sys
args = sys.argv[1:]
with open(os.path.join(os.path.dirname(sys.argv[0]), "calls.jsonl"), "a") as f:
    f.write(json.dumps(["nsenter", *args]) + "\\n")
if args[:4] != ["-t", "1", "-m", "--"]:
    print("nsenter: unexpected arguments", args, file=sys.stderr)
    sys.exit(2)
os.execvp(args[4], args[4:])
"""

# Like systemd: the unit gets a clean environment plus -E, and a forking unit's start ends
# when the started process exits (the daemon's parent, after the fork). Strict: unknown
# options and properties are refused. Inside `RootDirectory=` only what the root holds and
# what `BindPaths=` binds is visible: the binary is looked up in the root, and the daemon's
# pipe and log dirs must be bound in. `BindPaths=<dir>:/dev/shm` really binds (root only).
# Like a systemd before v247 (systemd.exec(5), MountAPIVFS=: off by default there, on with
# RootDirectory= only from v247): a unit in a RootDirectory= without MountAPIVFS=yes has no
# /proc and no /dev, so the daemon finds no GPU device node and exits.
SYSTEMD_RUN = """\
import json, os, sys
here = os.path.dirname(sys.argv[0])
args = sys.argv[1:]
with open(os.path.join(here, "calls.jsonl"), "a") as f:
    f.write(json.dumps(["systemd-run", *args]) + "\\n")
if os.path.exists(os.path.join(here, "fail")):
    print("Failed to connect to bus: No such file or directory", file=sys.stderr)
    sys.exit(1)
env = {"PATH": os.defpath}
props, binds = {}, []
i = 0
while args[i] != "--":
    a = args[i]
    if a == "-E":
        key, _, value = args[i + 1].partition("=")
        env[key] = value
        i += 2
        continue
    if a.startswith("--property="):
        key, _, value = a.removeprefix("--property=").partition("=")
        if key not in ("Type", "RootDirectory", "BindPaths", "MountAPIVFS"):
            print("Unknown assignment:", a, file=sys.stderr)
            sys.exit(1)
        if key == "BindPaths":
            binds.append(tuple(value.split(":", 1)) if ":" in value else (value, value))
        else:
            props[key] = value
    elif not (a.startswith("--unit=") or a in ("--collect", "--quiet")):
        print("systemd-run: unexpected option", a, file=sys.stderr)
        sys.exit(2)
    i += 1
if props.get("Type") != "forking":
    print("systemd-run: expected Type=forking", file=sys.stderr)
    sys.exit(2)
cmd = args[i + 1:]
root = props.get("RootDirectory", "/")
if root != "/":
    def bound(path):
        return any(path == dst or path.startswith(dst.rstrip("/") + "/") for _, dst in binds)
    for var in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        if not bound(env.get(var, "")):
            print(f"{var}={env.get(var)} is not visible under RootDirectory={root}",
                  file=sys.stderr)
            sys.exit(1)
    if props.get("MountAPIVFS") != "yes":
        print(f"{cmd[0]}: /dev/nvidiactl: No such file or directory (no /dev under {root})",
              file=sys.stderr)
        sys.exit(1)
    cmd[0] = os.path.join(root, cmd[0].lstrip("/"))
if not os.path.exists(cmd[0]):
    print(f"Failed to locate executable {cmd[0]}", file=sys.stderr)
    sys.exit(1)
shm = [src for src, dst in binds if dst == "/dev/shm"]
if shm:
    bind = 'mount --bind -- "$0" /dev/shm && exec "$@"'
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", bind, shm[0], *cmd]
    env["PATH"] = os.environ.get("PATH", os.defpath)
os.execvpe(cmd[0], cmd, env)
"""


@dataclass
class HostRig:
    root: Path
    tools: Path
    binary: Path  # the container's control binary: probes and settings
    host_binary: Path  # the host's: only systemd-run starts it
    board: HealthBoard = field(default_factory=HealthBoard)
    modes: RecordingModes = field(default_factory=RecordingModes)
    sups: list[MpsSupervisor] = field(default_factory=list)

    @property
    def config(self) -> Config:
        return Config(
            mps=MpsConfig(
                control_binary=str(self.binary),
                host_binary=str(self.host_binary),
                launcher="host-systemd",
                active_thread_percentage=25,
            )
        )

    def launcher_for(self, config: Config) -> launch.Launcher:
        return launch.from_config(
            config.mps,
            nsenter=str(self.tools / "nsenter"),
            systemd_run=str(self.tools / "systemd-run"),
            driver_root=config.cdi.driver_root,
            mps_root=self.root,
        )

    def supervisor(self) -> MpsSupervisor:
        config = self.config
        sup = MpsSupervisor(
            self.root,
            lambda: config,
            self.board,
            self.modes,
            timing=FAST,
            multiuser=False,
            launcher_for=self.launcher_for,
        )
        self.sups.append(sup)
        return sup

    def calls(self, tool: str) -> list[list[str]]:
        path = self.tools / "calls.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [c[1:] for c in map(json.loads, lines) if c[0] == tool]


def _script(path: Path, body: str) -> None:
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)


@pytest.fixture
def host(short_tmp: Path) -> Iterator[HostRig]:
    tools = short_tmp / "t"
    tools.mkdir()
    _script(tools / "nsenter", NSENTER)
    _script(tools / "systemd-run", SYSTEMD_RUN)
    binary = fake.write_launcher(short_tmp / "mps-control")
    host_binary = fake.write_launcher(short_tmp / "host-mps-control")
    rig = HostRig(short_tmp / "mps", tools, binary, host_binary)
    try:
        yield rig
    finally:
        for sup in rig.sups:
            sup.stop()
        kill_everything(rig.root)


def _ctl(rig: HostRig) -> MpsControl:
    return MpsControl(str(rig.binary), rig.root, GPU_A)


def test_supervisor_starts_probes_and_adopts_through_host_systemd(host: HostRig) -> None:
    sup = host.supervisor()
    sup.sync(slice_plan(gpu_plan(GPU_A, usable_gib=10)))
    sup.start()
    assert sup.wait_ready(GPU_A, 30), sup.snapshot()
    pid = layout.read_pid(host.root, GPU_A)
    assert pid is not None and pid_alive(pid)

    # Exactly one start, through nsenter into PID 1's mount namespace, then systemd-run.
    (ns,) = host.calls("nsenter")
    assert ns[:5] == ["-t", "1", "-m", "--", str(host.tools / "systemd-run")]
    (run,) = host.calls("systemd-run")
    assert run == ns[5:]
    assert f"--unit=gpu-fraction-mps-{GPU_A}.service" in run
    assert run[run.index("--") + 1 :] == [str(host.host_binary), "-d"]

    # The daemon's environment is systemd's clean one plus exactly the -E variables.
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(e.decode().partition("=")[::2] for e in environ if e)
    assert set(env) == MPS_VARS | {"PATH"}
    assert str(host.host_binary).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert env["CUDA_VISIBLE_DEVICES"] == GPU_A
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(layout.pipe_dir(host.root, GPU_A))

    # Settings verified, and the probe keeps running against it.
    assert _ctl(host).read_defaults(timeout=10) == (10 * 1024, 25.0)
    assert host.board.faults(GPU_A) == {}
    wait_until(lambda: sup.snapshot()[GPU_A].last_probe_latency is not None, what="a probe")
    pipe = layout.pipe_dir(host.root, GPU_A)
    fake.connect_client(pipe, 4242, os.getuid())
    fake.inject_fault(pipe)
    wait_until(lambda: FaultDomain.MPS_SERVER in host.board.faults(GPU_A), what="FAULT seen")
    fake.recover(pipe)
    wait_until(lambda: host.board.faults(GPU_A) == {}, what="ACTIVE again")
    fake.disconnect_client(pipe, 4242)

    # A new plugin adopts the same daemon: no second launch.
    sup.stop()
    assert pid_alive(pid)
    again = host.supervisor()
    again.sync(slice_plan(gpu_plan(GPU_A, usable_gib=10)))
    again.start()
    assert again.wait_ready(GPU_A, 30)
    snap = again.snapshot()[GPU_A]
    assert snap.pid == pid and snap.restarts == 0 and snap.state is DaemonState.READY
    assert len(host.calls("systemd-run")) == 1
    log = layout.control_log(host.root, GPU_A).read_text()
    assert log.count("Starting control daemon") == 1


def test_dead_daemon_is_relaunched_through_host_systemd(host: HostRig) -> None:
    sup = host.supervisor()
    sup.sync(slice_plan(gpu_plan(GPU_A)))
    sup.start()
    assert sup.wait_ready(GPU_A, 30)
    old = layout.read_pid(host.root, GPU_A)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: FaultDomain.MPS_DAEMON in host.board.faults(GPU_A), what="Unhealthy")
    wait_until(lambda: sup.snapshot()[GPU_A].restarts == 1, what="restart")
    wait_until(lambda: host.board.faults(GPU_A) == {}, what="Healthy again")
    new = sup.snapshot()[GPU_A].pid
    assert new is not None and new != old and pid_alive(new)
    assert len(host.calls("systemd-run")) == 2


def test_host_launch_failure_is_unhealthy_with_a_hint(host: HostRig) -> None:
    (host.tools / "fail").touch()
    sup = host.supervisor()
    sup.sync(slice_plan(gpu_plan(GPU_A)))
    sup.start()
    wait_until(lambda: sup.snapshot()[GPU_A].state is DaemonState.BACKOFF, what="a failed start")
    cause = host.board.faults(GPU_A)[FaultDomain.MPS_DAEMON].cause
    assert "start-failed" in cause and "Failed to connect to bus" in cause
    assert "hostPID: true" in cause
    assert layout.read_pid(host.root, GPU_A) is None
    # Once the host side works, the backoff retry brings the daemon up.
    (host.tools / "fail").unlink()
    assert sup.wait_ready(GPU_A, 30)
    assert host.board.faults(GPU_A) == {}


def test_control_start_reports_a_missing_nsenter(tmp_path: Path) -> None:
    ctl = MpsControl("mps-control", tmp_path, GPU_A)
    launcher = HostSystemdLauncher(nsenter=str(tmp_path / "no-such-nsenter"))
    with pytest.raises(ControlError, match=r"no-such-nsenter.*hostPID: true"):
        ctl.start(timeout=5, launcher=launcher)


# --- a driver root other than / and the shm dir (GPU Operator nodes) ------------------------


def test_host_systemd_unit_runs_in_the_driver_root_with_mps_root_and_shm_bound(
    tmp_path: Path,
) -> None:
    root = tmp_path / "mps"
    launcher = HostSystemdLauncher(
        host_binary="/usr/bin/nvidia-cuda-mps-control",
        driver_root="/run/nvidia/driver",
        mps_root=root,
    )
    ctl = MpsControl("nvidia-cuda-mps-control", root, GPU_A, base_env={})
    shm = layout.shm_dir(root, GPU_A)
    got = launcher.launch(ctl.binary, ["-d"], ctl.mps_env(), {}, GPU_A, shm)
    props = [a for a in got.argv if a.startswith("--property=")]
    assert props == [
        "--property=Type=forking",
        "--property=RootDirectory=/run/nvidia/driver",
        "--property=MountAPIVFS=yes",
        f"--property=BindPaths={root}",
        f"--property=BindPaths={shm}:/dev/shm",
    ]
    # With the host's own driver (root /): no RootDirectory, the shm bind stays.
    plain = HostSystemdLauncher(mps_root=root).launch(ctl.binary, ["-d"], {}, {}, GPU_A, shm)
    assert [a for a in plain.argv if a.startswith("--property=")] == [
        "--property=Type=forking",
        f"--property=BindPaths={shm}:/dev/shm",
    ]
    with pytest.raises(LaunchError, match="MPS root"):
        HostSystemdLauncher(driver_root="/run/nvidia/driver").launch("b", ["-d"], {}, {}, GPU_A)


def test_direct_launcher_binds_the_shm_dir_in_a_namespace_of_its_own(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    got = DirectLauncher().launch(
        "/x/mps-control", ["-d"], {"A": "1"}, {"PATH": "/bin"}, GPU_A, shm
    )
    assert got.argv[:5] == ("unshare", "--mount", "--propagation", "private", "--")
    assert got.argv[-3:] == (str(shm), "/x/mps-control", "-d")
    assert got.env == {"PATH": "/bin", "A": "1"}


def test_fake_systemd_run_refuses_unknown_properties(host: HostRig) -> None:
    import subprocess

    done = subprocess.run(
        [str(host.tools / "systemd-run"), "--unit=x.service", "--property=Type=forking",
         "--property=PrivateTmp=yes", "--", "/bin/true"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 1 and "Unknown assignment" in done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="the shm bind needs a mount namespace")
def test_host_systemd_with_a_driver_root_starts_the_daemon_that_clients_reach(
    host: HostRig,
) -> None:
    # The daemon binary exists only inside the driver root, as on a GPU Operator node.
    driver = host.root.parent / "driver"
    (driver / "usr" / "bin").mkdir(parents=True)
    fake.write_launcher(driver / "usr" / "bin" / "nvidia-cuda-mps-control")
    config = dataclasses.replace(
        host.config,
        cdi=dataclasses.replace(host.config.cdi, driver_root=str(driver)),
        mps=dataclasses.replace(host.config.mps, host_binary="/usr/bin/nvidia-cuda-mps-control"),
    )
    sup = MpsSupervisor(
        host.root,
        lambda: config,
        host.board,
        host.modes,
        timing=FAST,
        multiuser=False,
        launcher_for=host.launcher_for,
        shm_states=lambda: {GPU_A: ShmState.TMPFS},
    )
    host.sups.append(sup)
    sup.sync(slice_plan(gpu_plan(GPU_A)))
    sup.start()
    assert sup.wait_ready(GPU_A, 30), sup.snapshot()
    (run,) = host.calls("systemd-run")
    shm = layout.shm_dir(host.root, GPU_A)
    assert f"--property=RootDirectory={driver}" in run
    assert "--property=MountAPIVFS=yes" in run  # else no /proc, /dev on an older systemd
    assert f"--property=BindPaths={host.root}" in run
    assert f"--property=BindPaths={shm}:/dev/shm" in run
    # The daemon's /dev/shm is the GPU's shm dir: its marker is there.
    pid = layout.read_pid(host.root, GPU_A)
    assert (shm / f"{mps_daemon.SHM_PREFIX}{pid}").exists()


@pytest.mark.parametrize(
    "host_binary",
    ["/usr/bin/nvidia-cuda-mps-control", "/run/nvidia/driver/usr/bin/nvidia-cuda-mps-control"],
)
def test_host_binary_inside_the_driver_root_in_either_form(
    tmp_path: Path, host_binary: str
) -> None:
    launcher = HostSystemdLauncher(
        host_binary=host_binary, driver_root="/run/nvidia/driver/", mps_root=tmp_path
    )
    got = launcher.launch("nvidia-cuda-mps-control", ["-d"], {}, {}, GPU_A)
    assert got.argv[got.argv.index("--", 5) + 1 :] == ("/usr/bin/nvidia-cuda-mps-control", "-d")
    # With the host's own driver (root /) the path is used as it is.
    plain = HostSystemdLauncher(host_binary=host_binary).launch("x", ["-d"], {}, {}, GPU_A)
    assert plain.argv[plain.argv.index("--", 5) + 1] == host_binary
