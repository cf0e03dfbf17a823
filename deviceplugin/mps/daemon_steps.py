"""The steps that adopt, start and quit one GPU's MPS control daemon.

`DaemonSteps` runs on the worker's thread (worker.py): whether a live daemon can be adopted
(its settings read back and compared with what the plan wants), a fresh start (compute mode,
launcher, the multi-user fallback, defaults set and read back, memory accounting, the
marker), the wait for its pid file and a quit that waits for the process to exit. The steps
talk to the control client and the files under the MPS root and change no worker state: each
returns what it established (`Adopted`, `Started`) for the worker to record.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from deviceplugin.model import GpuUuid
from deviceplugin.mps import layout
from deviceplugin.mps.control import AlreadyRunning, ControlError, MpsControl, mem_limit_matches
from deviceplugin.mps.daemon_state import WorkerHost
from deviceplugin.mps.launch import Launcher
from deviceplugin.mps.layout import DaemonMarker, MpsSettings
from deviceplugin.plan import GpuPlan
from deviceplugin.plumbing import logs
from deviceplugin.plumbing.exits import PidFd
from deviceplugin.plumbing.process import pid_alive

_log = logs.get("mps")


@dataclass(frozen=True)
class Adopted:
    """A live daemon taken over."""

    marker: DaemonMarker | None  # the marker under the GPU's dir, whoever wrote it
    settings: MpsSettings | None  # what it was started with, when its marker says so
    settings_pending: bool  # they differ from the plan's: restart once it has no clients
    memory_accounting: bool


@dataclass(frozen=True)
class Started:
    """A fresh daemon, its defaults applied and its marker written."""

    pid: int
    settings: MpsSettings  # what it runs with (single-UID after a refused multi-user start)
    memory_accounting: bool
    launcher: Launcher
    started_at: float  # the supervisor's clock
    pidfd: PidFd | None = None  # opened right after its pid was confirmed; None: probes only


class DaemonSteps:
    """One GPU's daemon adopted, started or quit; a failed step raises ControlError (or
    LayoutError, OSError)."""

    def __init__(self, sup: WorkerHost, gpu: GpuUuid, ctl: MpsControl) -> None:
        self.sup = sup
        self.gpu = gpu
        self.ctl = ctl

    def adopt(self, pid: int, wanted: MpsSettings) -> Adopted | None:
        """Take over a live daemon; None when it was quit so a fresh one can start."""
        timeout = self.sup.timing.command_timeout
        servers = self.ctl.server_list(timeout)
        pinned, atp = self.ctl.read_defaults(timeout)
        marker = layout.read_marker(self.sup.root, self.gpu)
        known = marker.settings if marker is not None and marker.pid == pid else None
        same = (
            known == wanted
            and mem_limit_matches(pinned, wanted.pinned_limit_mib)
            and atp == float(wanted.active_thread_percentage)
        )
        if not same:
            clients = self.ctl.client_count(servers, timeout)
            if clients == 0:
                logs.log(_log, "mps daemon restart: settings differ", gpu=self.gpu, pid=pid)
                self.quit(pid)
                return None
            logs.log(
                _log,
                "mps daemon kept: settings differ but it has clients",
                level=logging.WARNING,
                gpu=self.gpu,
                pid=pid,
                clients=clients,
            )
        accounting = self.memory_accounting(wanted, enable=False)
        return Adopted(marker, known, not same, accounting)

    def start(self, plan: GpuPlan, settings: MpsSettings) -> Started:
        """Start a fresh daemon for `plan` with `settings` and prove they took."""
        mps = self.sup.mps_config()
        timeout = self.sup.timing.command_timeout
        marker = layout.read_marker(self.sup.root, self.gpu)
        compute_mode_set = marker.compute_mode_set if marker is not None else False
        if self.sup.set_exclusive(self.gpu):
            compute_mode_set = True
        layout.clean_pipe_dir(self.sup.root, self.gpu)
        launcher = self.sup.launcher_for(self.sup.config_source())
        shm = self.sup.shm_for(self.gpu)
        try:
            self.ctl.start(
                protocol_version=mps.protocol_version,
                multiuser=settings.multiuser,
                timeout=timeout,
                launcher=launcher,
                shm=shm,
            )
        except AlreadyRunning:
            raise
        except ControlError as exc:
            if not (settings.multiuser and self.sup.multiuser_auto):
                raise
            # Auto mode: this driver's daemon refused -multiuser-server; one UID per GPU then.
            logs.log(
                _log,
                "mps multi-user unavailable",
                level=logging.WARNING,
                gpu=self.gpu,
                error=str(exc),
            )
            self.sup.multiuser_failed()
            settings = self.sup.settings_for(plan)
            layout.clean_pipe_dir(self.sup.root, self.gpu)
            self.ctl.start(
                protocol_version=mps.protocol_version,
                multiuser=False,
                timeout=timeout,
                launcher=launcher,
                shm=shm,
            )
        pid = self.wait_pid()
        # Right after its pid file named a live process: a pid reused later cannot fool it.
        pidfd = self.sup.exit_watch.open(pid)
        try:
            self.ctl.set_defaults(
                settings.pinned_limit_mib, settings.active_thread_percentage, timeout
            )
            pinned, atp = self.ctl.read_defaults(timeout)
            if not mem_limit_matches(pinned, settings.pinned_limit_mib) or atp != float(
                settings.active_thread_percentage
            ):
                raise ControlError(
                    f"gpu={self.gpu} defaults not applied: pinned={pinned}MiB atp={atp} "
                    f"wanted {settings.pinned_limit_mib}MiB/{settings.active_thread_percentage}"
                )
            accounting = self.memory_accounting(settings, enable=True)
            now = self.sup.clock()
            layout.write_marker(
                self.sup.root,
                self.gpu,
                DaemonMarker(pid, settings, compute_mode_set, time.time()),
            )
        except BaseException:
            if pidfd is not None:
                pidfd.close()
            raise
        return Started(pid, settings, accounting, launcher, now, pidfd)

    def memory_accounting(self, settings: MpsSettings, *, enable: bool) -> bool:
        """Protocol 3 only: accounting on (when `enable`) and confirmed by readback. Without
        that proof borrowed memory is not reclaimable (DESIGN 3b), so failures read False."""
        if settings.protocol_version != 3:
            return False
        timeout = self.sup.timing.command_timeout
        try:
            if enable:
                confirmed = self.ctl.enable_memory_accounting(timeout)
            else:
                confirmed = self.ctl.memory_accounting(timeout)
        except ControlError as exc:
            confirmed, error = False, str(exc)
        else:
            error = "" if confirmed else "readback is not on"
        if not confirmed:
            logs.log(
                _log,
                "mps memory accounting not confirmed: borrowed memory is not reclaimable",
                level=logging.WARNING,
                gpu=self.gpu,
                error=error,
            )
        return confirmed

    def wait_pid(self) -> int:
        deadline = time.monotonic() + self.sup.timing.command_timeout
        while time.monotonic() < deadline:
            pid = layout.read_pid(self.sup.root, self.gpu)
            if pid is not None and pid_alive(pid):
                return pid
            time.sleep(0.02)
        raise ControlError(f"gpu={self.gpu} daemon wrote no live pid file")

    def quit(self, pid: int) -> None:
        self.ctl.quit(self.sup.timing.command_timeout)
        deadline = time.monotonic() + self.sup.timing.command_timeout
        while pid_alive(pid):
            if time.monotonic() > deadline:
                raise ControlError(f"gpu={self.gpu} daemon {pid} did not exit after quit")
            time.sleep(0.02)
