"""How an MPS control daemon is started: from the plugin's process, or by the host's systemd.

`direct` runs `<binary> -d …` in a session of its own: enough on bare metal and in simulation,
where killing the plugin's process group spares it. `host-systemd` hands the same command to
the host's init system (`nsenter -t 1 -m -- systemd-run …`) so the daemon lives in the host's
cgroup tree and outlives the plugin's container (docs/mps.md, "Lifetime"). Either way the
GPU's shm dir becomes the daemon's `/dev/shm`: `direct` starts it in a mount namespace of its
own with the dir bound there, the unit gets `BindPaths=<shm>:/dev/shm`. Argument lists only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from deviceplugin.config.settings import LAUNCHER_DIRECT, LAUNCHER_HOST_SYSTEMD, MpsConfig
from deviceplugin.model import GpuUuid
from deviceplugin.mps import layout

UNIT_PREFIX = "gpu-fraction-mps-"
# systemd's unit name alphabet and length (UNIT_NAME_MAX is 256 with the NUL).
_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.\\-]+\.service$")
UNIT_NAME_MAX = 255
# A private mount namespace whose /dev/shm is the GPU's shm dir ($0), then the daemon ($@).
BIND_SHM = 'mount --bind -- "$0" /dev/shm && exec "$@"'


class LaunchError(Exception):
    """A launcher cannot build a command for this GPU."""


@dataclass(frozen=True)
class Launch:
    """What to run: the argument list and the environment of the process the plugin starts."""

    argv: tuple[str, ...]
    env: dict[str, str]


class Launcher(Protocol):
    name: str

    def launch(
        self,
        binary: str,
        args: Sequence[str],
        mps_env: Mapping[str, str],
        base_env: Mapping[str, str],
        uuid: GpuUuid,
        shm: Path | None = None,
    ) -> Launch:
        """`binary args` with `mps_env` (the CUDA_MPS_* and CUDA_VISIBLE_DEVICES variables);
        `shm`: the dir to be the daemon's /dev/shm (None: it keeps the one it has)."""
        ...

    def hint(self) -> str:
        """What to check when the start fails; "" when nothing launcher-specific."""
        ...


class DirectLauncher:
    """The daemon as a child of the plugin; the caller starts it in a new session.

    With `shm`, `unshare` gives it a private mount namespace in which the shm dir is bound
    at /dev/shm; the daemon forks and keeps that namespace, the plugin's stays untouched.
    """

    name = LAUNCHER_DIRECT

    def __init__(self, unshare: str = "unshare", sh: str = "sh") -> None:
        self.unshare = unshare
        self.sh = sh

    def launch(
        self,
        binary: str,
        args: Sequence[str],
        mps_env: Mapping[str, str],
        base_env: Mapping[str, str],
        uuid: GpuUuid,
        shm: Path | None = None,
    ) -> Launch:
        env = {**base_env, **mps_env}
        if shm is None:
            return Launch((binary, *args), env)
        ns = (self.unshare, "--mount", "--propagation", "private", "--")
        return Launch((*ns, self.sh, "-c", BIND_SHM, str(shm), binary, *args), env)

    def hint(self) -> str:
        return ""


def unit_name(uuid: str) -> str:
    """`gpu-fraction-mps-<GPU-UUID>.service`: one stable name per GPU, so operators find it."""
    try:
        name = f"{UNIT_PREFIX}{layout.check_uuid(uuid)}.service"
    except layout.LayoutError as exc:
        raise LaunchError(str(exc)) from exc
    if len(name) > UNIT_NAME_MAX or not _UNIT_RE.fullmatch(name):
        raise LaunchError(f"gpu={uuid} does not make a valid systemd unit name: {name!r}")
    return name


class HostSystemdLauncher:
    """A transient unit of the host's systemd, entered through PID 1's mount namespace.

    `-d` with `Type=forking`: systemd-run returns once the daemon has forked (as the direct
    start does), the daemon writes its pid file and control.log exactly as it does everywhere
    else, and systemd tracks the forked daemon as the unit's main process. `--collect` unloads
    the unit when the daemon exits, even after a failure, so the name is free for a restart.
    The daemon gets only the variables passed with `-E`: systemd does not pass ours on.
    With a driver root other than `/` (GPU Operator: `/run/nvidia/driver`) the unit runs
    with `RootDirectory=` there, so the daemon finds its server binary and libcuda, and the
    MPS root is bound into it at the same path (`BindPaths=`), as is the shm dir at /dev/shm.
    `MountAPIVFS=yes` is set with it: the daemon needs /proc and /dev (the GPU's device nodes)
    inside that root, and systemd before v247 (RHEL 8's v239, for one) defaults it to off.
    """

    name = LAUNCHER_HOST_SYSTEMD

    def __init__(
        self,
        host_binary: str | None = None,
        nsenter: str = "nsenter",
        systemd_run: str = "systemd-run",
        target_pid: int = 1,
        driver_root: str = "/",
        mps_root: Path | None = None,
    ) -> None:
        """`host_binary`: the control binary's path on the host, inside `driver_root` (None:
        the plugin's own); `mps_root`: bound into the unit when `driver_root` is not `/`."""
        self.host_binary = host_binary
        self.nsenter = nsenter
        self.systemd_run = systemd_run
        self.target_pid = target_pid
        self.driver_root = driver_root
        self.mps_root = mps_root

    def unit_binary(self, binary: str) -> str:
        """The binary's path as the unit sees it: inside `RootDirectory=` a host path under
        the driver root (`/run/nvidia/driver/usr/bin/…`) is `/usr/bin/…`; both forms work."""
        path = self.host_binary or binary
        root = self.driver_root.rstrip("/")
        if root and path.startswith(root + "/"):
            return path[len(root) :]
        return path

    def properties(self, shm: Path | None) -> list[str]:
        """The unit's properties beyond Type=forking: root directory and bind mounts."""
        props: list[str] = []
        if self.driver_root.rstrip("/"):
            if self.mps_root is None:
                raise LaunchError(
                    f"cdi.driverRoot {self.driver_root} needs the MPS root bound into the unit"
                )
            props += [
                f"RootDirectory={self.driver_root}",
                "MountAPIVFS=yes",
                f"BindPaths={self.mps_root}",
            ]
        if shm is not None:
            props.append(f"BindPaths={shm}:/dev/shm")
        return [f"--property={p}" for p in props]

    def launch(
        self,
        binary: str,
        args: Sequence[str],
        mps_env: Mapping[str, str],
        base_env: Mapping[str, str],
        uuid: GpuUuid,
        shm: Path | None = None,
    ) -> Launch:
        setenv: list[str] = []
        for key, value in sorted(mps_env.items()):
            setenv += ["-E", f"{key}={value}"]
        argv = (
            self.nsenter,
            "-t",
            str(self.target_pid),
            "-m",
            "--",
            self.systemd_run,
            f"--unit={unit_name(uuid)}",
            "--collect",
            "--quiet",
            "--property=Type=forking",
            *self.properties(shm),
            *setenv,
            "--",
            self.unit_binary(binary),
            *args,
        )
        # nsenter and systemd-run run with the plugin's environment (PATH); the daemon does not.
        return Launch(argv, dict(base_env))

    def hint(self) -> str:
        return (
            "(mps.launcher host-systemd needs a privileged pod with hostPID: true, systemd on "
            "the host, and mps.hostBinary where the host keeps nvidia-cuda-mps-control)"
        )


def from_config(
    mps: MpsConfig,
    nsenter: str = "nsenter",
    systemd_run: str = "systemd-run",
    *,
    driver_root: str = "/",
    mps_root: Path | None = None,
) -> Launcher:
    """The launcher `mps.launcher` names; the tool paths are for tests."""
    if mps.launcher == LAUNCHER_HOST_SYSTEMD:
        return HostSystemdLauncher(
            mps.host_binary,
            nsenter=nsenter,
            systemd_run=systemd_run,
            driver_root=driver_root,
            mps_root=mps_root,
        )
    return DirectLauncher()
