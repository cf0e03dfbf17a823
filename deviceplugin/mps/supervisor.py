"""MpsSupervisor: one control daemon per sm-sharing GPU, started, adopted, probed, restarted.

It keeps one `DaemonWorker` (worker.py: bring-up, exit watch, probes, log cap, board faults) per
sm-sharing GPU of the current plan, sets compute modes where allowed, answers the
allocator (`ensure`, `wait_ready`, `memory_accounting`) and the health monitor
(`server_active`), and quits daemons for `mps stop`. Daemons start through the launcher
`mps.launcher` names (own session, or a host systemd unit), with the GPU's shm dir as their
/dev/shm, and outlive the plugin; `stop()` leaves them running, `stop_daemons()` quits them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from deviceplugin.config.settings import Config, MpsConfig
from deviceplugin.health.board import HealthBoard
from deviceplugin.health.faults import MpsServerActive
from deviceplugin.health.verdicts import STARTING
from deviceplugin.model import FaultDomain, GpuUuid, Mode
from deviceplugin.mps import launch, layout
from deviceplugin.mps.control import (
    ControlError,
    MpsControl,
    ServerState,
)
from deviceplugin.mps.daemon_state import (
    DaemonSnapshot,
    DaemonState,
    Timing,
    backoff_delay,
    desired_settings,
)
from deviceplugin.mps.launch import Launcher
from deviceplugin.mps.layout import LayoutError, MpsSettings
from deviceplugin.mps.shm import ShmState
from deviceplugin.mps.tenants import TenantMode
from deviceplugin.mps.worker import DaemonWorker
from deviceplugin.plan import GpuPlan, SlicePlan
from deviceplugin.plumbing import logs
from deviceplugin.plumbing.exits import ExitWatch
from deviceplugin.plumbing.process import pid_alive

__all__ = [
    "ComputeModes",
    "DaemonSnapshot",
    "DaemonState",
    "MpsSupervisor",
    "Timing",
    "backoff_delay",
    "desired_settings",
]

COMPUTE_MODE_DEFAULT = 0  # NVML_COMPUTEMODE_DEFAULT
COMPUTE_MODE_EXCLUSIVE_PROCESS = 3  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS

_log = logs.get("mps")


class ComputeModes(Protocol):
    """What the supervisor needs from NVML; `nvml.NvmlSession` implements it."""

    def get_compute_mode(self, uuid: GpuUuid) -> int: ...

    def set_compute_mode(self, uuid: GpuUuid, mode: int) -> None: ...


class MpsSupervisor:
    """Keeps one verified MPS control daemon per sm-sharing GPU of the current plan."""

    def __init__(
        self,
        mps_root: Path,
        config_source: Callable[[], Config],
        board: HealthBoard,
        compute_modes: ComputeModes | None,
        clock: Callable[[], float] = time.monotonic,
        timing: Timing | None = None,
        multiuser: bool | None = None,
        launcher_for: Callable[[Config], Launcher] | None = None,
        shm_states: Callable[[], dict[GpuUuid, ShmState]] | None = None,
    ) -> None:
        """`multiuser` None = auto: `-multiuser-server` when root, falling back if refused.
        `launcher_for` turns the current config into the launcher of the next start;
        `shm_states` says per GPU whether its shm dir is the daemon's /dev/shm (None: never,
        each daemon keeps the /dev/shm it starts with)."""
        self.root = mps_root
        self.config_source = config_source
        self.board = board
        self.compute_modes = compute_modes
        self.clock = clock
        self.timing = timing or Timing()
        self.multiuser_auto = multiuser is None
        self.launcher_for = launcher_for or self._launcher_for
        self.shm_states = shm_states
        self._multiuser = os.geteuid() == 0 if multiuser is None else multiuser
        self._lock = threading.Lock()
        self._workers: dict[GpuUuid, DaemonWorker] = {}
        self._started = False
        # One thread waits on every daemon's pidfd: a death is seen at once, not at a probe.
        self.exit_watch = ExitWatch("mps-exits")

    # --- configuration ---

    def mps_config(self) -> MpsConfig:
        return self.config_source().mps

    def _launcher_for(self, config: Config) -> Launcher:
        return launch.from_config(
            config.mps, driver_root=config.cdi.driver_root, mps_root=self.root
        )

    def probe_interval(self) -> float:
        interval = self.timing.probe_interval
        return self.mps_config().probe_interval if interval is None else interval

    def probe_failures(self) -> int:
        failures = self.timing.probe_failures
        return self.mps_config().probe_failures if failures is None else failures

    def shm_state(self, gpu: GpuUuid) -> ShmState:
        states = self.shm_states() if self.shm_states is not None else {}
        return states.get(gpu, ShmState.HOST)

    def shm_for(self, gpu: GpuUuid) -> Path | None:
        """The dir to bind at the daemon's /dev/shm, or None to keep the one it has."""
        return layout.shm_dir(self.root, gpu) if self.shm_state(gpu).bound else None

    def tenant_mode(self) -> TenantMode:
        return TenantMode.MULTI_USER if self._multiuser else TenantMode.SINGLE_UID

    def multiuser_failed(self) -> None:
        self._multiuser = False

    def settings_for(self, plan: GpuPlan) -> MpsSettings:
        return desired_settings(plan, self.mps_config(), self._multiuser)

    def set_exclusive(self, gpu: GpuUuid) -> bool:
        """EXCLUSIVE_PROCESS before a start when allowed; True when we changed it."""
        return self._set_mode(gpu, COMPUTE_MODE_EXCLUSIVE_PROCESS)

    def _set_mode(self, gpu: GpuUuid, mode: int) -> bool:
        if self.compute_modes is None or not self.mps_config().set_compute_mode:
            return False
        current = self.compute_modes.get_compute_mode(gpu)
        if current == mode:
            return False
        self.compute_modes.set_compute_mode(gpu, mode)
        logs.log(_log, "compute mode set", gpu=gpu, mode=mode, previous=current)
        return True

    # --- lifecycle ---

    def start(self) -> None:
        with self._lock:
            self._started = True
            workers = list(self._workers.values())
        for worker in workers:
            worker.start()

    def stop(self) -> None:
        """Stop supervising; the daemons keep running (their lifetime is their own)."""
        with self._lock:
            self._started = False
            workers = list(self._workers.values())
        for worker in workers:
            worker.stop()
        self.exit_watch.close()
        with self._lock:
            self._workers = {g: w for g, w in self._workers.items() if w not in workers}

    def sync(self, plan: SlicePlan) -> None:
        """Follow a new plan: daemons for its sm-sharing GPUs, DEFAULT mode for the others.

        Blocking (compute modes, quitting retired daemons): call it off the event loop.
        """
        wanted = {p.uuid: p for p in plan.gpus if p.mode is Mode.SM_SHARING and p.advertised}
        with self._lock:
            retired = [w for g, w in self._workers.items() if g not in wanted]
            for worker in retired:
                del self._workers[worker.gpu]
            fresh: list[DaemonWorker] = []
            for gpu, gpu_plan in wanted.items():
                existing = self._workers.get(gpu)
                if existing is None:
                    self._workers[gpu] = DaemonWorker(self, gpu_plan)
                    fresh.append(self._workers[gpu])
                else:
                    existing.update(gpu_plan)
            started = self._started
        for worker in fresh:
            self.board.set(worker.gpu, FaultDomain.MPS_DAEMON, STARTING)
            if started:
                worker.start()
        for worker in retired:
            worker.stop()
            try:
                self._retire(worker.gpu, force=False)
            except (ControlError, LayoutError, OSError) as exc:
                logs.log(
                    _log,
                    "mps daemon not retired",
                    level=logging.WARNING,
                    gpu=worker.gpu,
                    error=str(exc),
                )
        for gpu_plan in plan.gpus:
            if gpu_plan.uuid not in wanted and gpu_plan.mode is not Mode.SM_SHARING:
                self._default_mode(gpu_plan.uuid)

    def _default_mode(self, gpu: GpuUuid) -> None:
        if layout.read_marker(self.root, gpu) is not None:
            return  # a daemon we started is still there (it had clients); mode stays
        try:
            self._set_mode(gpu, COMPUTE_MODE_DEFAULT)
        except Exception as exc:  # NVML errors are the helper's types; log and go on
            logs.log(
                _log, "compute mode not restored", level=logging.WARNING, gpu=gpu, error=str(exc)
            )

    # --- the MpsGate seam used by the allocator ---

    def ensure(self, gpu: GpuUuid) -> bool:
        """Non-blocking: True when the daemon is up and verified, else nudges a start."""
        with self._lock:
            worker = self._workers.get(gpu)
        if worker is None:
            return False
        if worker.ready.is_set():
            return True
        worker.kick()
        return False

    def wait_ready(self, gpu: GpuUuid, timeout: float) -> bool:
        with self._lock:
            worker = self._workers.get(gpu)
        return worker is not None and worker.ready.wait(timeout)

    def memory_accounting(self, gpu: GpuUuid) -> bool:
        """Whether the GPU's daemon is proven to account memory per client (protocol 3)."""
        with self._lock:
            worker = self._workers.get(gpu)
        return worker is not None and worker.snapshot().memory_accounting

    def server_active(self, gpu: GpuUuid, since: float | None = None) -> bool | None:
        """True only on a positive ACTIVE for every server the daemon lists at its last
        probe, when that probe started at or after `since` (this supervisor's clock); False
        when one is not ACTIVE (or answered what the parser does not know); None when
        unknown (not READY, no probe since, a listed server not asked about yet).

        A daemon listing no server has no faulted one (a new client gets a fresh server), so
        that counts as ACTIVE once the probe is recent enough: else a fault would outlive a
        restarted daemon for good, its slices Unhealthy so no client ever starts a server.
        """
        snap = self.snapshot().get(gpu)
        if snap is None or snap.state is not DaemonState.READY or snap.server_states is None:
            return None
        if since is not None and (snap.probed_at is None or snap.probed_at < since):
            return None
        return all(s is ServerState.ACTIVE for s in snap.server_states.values())

    # --- operator and metrics ---

    def snapshot(self) -> dict[GpuUuid, DaemonSnapshot]:
        with self._lock:
            workers = list(self._workers.values())
        return {w.gpu: w.snapshot() for w in workers}

    def stop_daemons(
        self, gpus: Iterable[GpuUuid] | None = None, force: bool = False
    ) -> dict[GpuUuid, str]:
        """`mps stop`: quit daemons (all under the root when `gpus` is None), restore DEFAULT
        where we set it. A daemon with clients is left alone unless `force`. Returns gpu → outcome.
        """
        targets = list(layout.known_gpus(self.root) if gpus is None else gpus)
        results: dict[GpuUuid, str] = {}
        for gpu in targets:
            with self._lock:
                worker = self._workers.pop(gpu, None)
            if worker is not None:
                worker.stop()
            try:
                results[gpu] = self._retire(layout.check_uuid(gpu), force=force)
            except (ControlError, LayoutError, OSError) as exc:
                results[gpu] = f"error: {exc}"
        return results

    def _retire(self, gpu: GpuUuid, force: bool) -> str:
        ctl = MpsControl(self.mps_config().control_binary, self.root, gpu)
        timeout = self.timing.command_timeout
        pid = layout.read_pid(self.root, gpu)
        outcome = "not-running"
        if pid is not None and pid_alive(pid):
            if not force:
                clients = ctl.client_count(ctl.server_list(timeout), timeout)
                if clients:
                    logs.log(
                        _log,
                        "mps daemon kept: has clients",
                        level=logging.WARNING,
                        gpu=gpu,
                        clients=clients,
                    )
                    return f"kept: {clients} clients"
            ctl.quit(timeout)
            deadline = time.monotonic() + timeout
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            outcome = "stopped"
            logs.log(_log, "mps daemon stopped", gpu=gpu, pid=pid)
        layout.clean_pipe_dir(self.root, gpu)
        marker = layout.read_marker(self.root, gpu)
        if marker is not None and marker.compute_mode_set and self.compute_modes is not None:
            self.compute_modes.set_compute_mode(gpu, COMPUTE_MODE_DEFAULT)
            logs.log(_log, "compute mode restored", gpu=gpu, mode=COMPUTE_MODE_DEFAULT)
            outcome += ", compute mode DEFAULT"
        layout.remove_marker(self.root, gpu)
        self.board.clear(gpu, FaultDomain.MPS_DAEMON)
        self.board.clear(gpu, FaultDomain.MPS_SERVER)
        return outcome


def supervisor_server_active(supervisor: MpsSupervisor) -> MpsServerActive:
    """The supervisor's last probe: True only on a positive ACTIVE for every server its
    daemon lists (DESIGN 3b), at a probe taken after the Xid; a daemon that is not READY,
    a probe from before, or an answer the parser does not know keeps the fault."""
    return supervisor.server_active
