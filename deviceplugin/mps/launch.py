"""How an MPS control daemon is started: from the plugin's process, or by the host's systemd.

`direct` runs `<binary> -d …` in a session of its own: enough on bare metal and in simulation,
where killing the plugin's process group spares it. `host-systemd` hands the same command to
the host's init system (`nsenter -t 1 -m -- systemd-run …`) so the daemon lives in the host's
cgroup tree and outlives the plugin's container (docs/mps.md, "Lifetime"). Argument lists only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from deviceplugin.config import LAUNCHER_DIRECT, LAUNCHER_HOST_SYSTEMD, MpsConfig
from deviceplugin.model import GpuUuid
from deviceplugin.mps import layout

UNIT_PREFIX = "gpu-fraction-mps-"
# systemd's unit name alphabet and length (UNIT_NAME_MAX is 256 with the NUL).
_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.\\-]+\.service$")
UNIT_NAME_MAX = 255


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
    ) -> Launch:
        """`binary args` with `mps_env` (the CUDA_MPS_* and CUDA_VISIBLE_DEVICES variables)."""
        ...

    def hint(self) -> str:
        """What to check when the start fails; "" when nothing launcher-specific."""
        ...


class DirectLauncher:
    """The daemon as a child of the plugin; the caller starts it in a new session."""

    name = LAUNCHER_DIRECT

    def launch(
        self,
        binary: str,
        args: Sequence[str],
        mps_env: Mapping[str, str],
        base_env: Mapping[str, str],
        uuid: GpuUuid,
    ) -> Launch:
        return Launch((binary, *args), {**base_env, **mps_env})

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
    """

    name = LAUNCHER_HOST_SYSTEMD

    def __init__(
        self,
        host_binary: str | None = None,
        nsenter: str = "nsenter",
        systemd_run: str = "systemd-run",
        target_pid: int = 1,
    ) -> None:
        """`host_binary`: the control binary's path on the host (None: the plugin's own)."""
        self.host_binary = host_binary
        self.nsenter = nsenter
        self.systemd_run = systemd_run
        self.target_pid = target_pid

    def launch(
        self,
        binary: str,
        args: Sequence[str],
        mps_env: Mapping[str, str],
        base_env: Mapping[str, str],
        uuid: GpuUuid,
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
            *setenv,
            "--",
            self.host_binary or binary,
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
    mps: MpsConfig, nsenter: str = "nsenter", systemd_run: str = "systemd-run"
) -> Launcher:
    """The launcher `mps.launcher` names; the tool paths are for tests."""
    if mps.launcher == LAUNCHER_HOST_SYSTEMD:
        return HostSystemdLauncher(mps.host_binary, nsenter=nsenter, systemd_run=systemd_run)
    return DirectLauncher()
