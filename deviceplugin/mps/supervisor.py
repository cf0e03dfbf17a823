"""MpsSupervisor: one control daemon per sm-sharing GPU, started, adopted, probed, restarted.

One worker thread per sm-sharing GPU brings its daemon up (adopting a running one when pid
file, probe and settings agree), probes it every `probe_interval` under a timeout, and turns
what it sees into HealthBoard faults (MPS_DAEMON: dead, wedged, not started; MPS_SERVER: a
server in FAULT, or a second UID waiting). Daemons start through the launcher `mps.launcher`
names (own session, or a host systemd unit) and outlive the plugin; `stop()` leaves them
running, `stop_daemons()` quits them (`mps stop`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from deviceplugin import logs
from deviceplugin.config import Config, MpsConfig
from deviceplugin.healthboard import HealthBoard
from deviceplugin.model import MIB, FaultDomain, GpuUuid, Mode
from deviceplugin.mps import launch, layout
from deviceplugin.mps.control import (
    AlreadyRunning,
    ControlError,
    ControlTimeout,
    MpsControl,
    ServerState,
    mem_limit_matches,
)
from deviceplugin.mps.launch import Launcher
from deviceplugin.mps.layout import DaemonMarker, LayoutError, MpsSettings
from deviceplugin.mps.tenants import TenantMode, TenantWatch
from deviceplugin.plan import GpuPlan, SlicePlan
from deviceplugin.process import pid_alive

COMPUTE_MODE_DEFAULT = 0  # NVML_COMPUTEMODE_DEFAULT
COMPUTE_MODE_EXCLUSIVE_PROCESS = 3  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS

_log = logs.get("mps")


class ComputeModes(Protocol):
    """What the supervisor needs from NVML; `nvml.NvmlSession` implements it."""

    def get_compute_mode(self, uuid: GpuUuid) -> int: ...

    def set_compute_mode(self, uuid: GpuUuid, mode: int) -> None: ...


class DaemonState(StrEnum):
    STARTING = "starting"  # first bring-up pending or running
    READY = "ready"  # probe passes
    BACKOFF = "backoff"  # dead or failed to start; next attempt at `next_attempt`
    WEDGED = "wedged"  # alive but not answering in time
    STOPPED = "stopped"


@dataclass(frozen=True)
class Timing:
    """Probe and restart pacing; tests shrink these."""

    probe_interval: float = 1.0
    probe_timeout: float = 1.0
    command_timeout: float = 10.0  # start, set, verify, quit
    backoff_base: float = 1.0
    backoff_max: float = 30.0
    stable_reset: float = 300.0  # this long READY resets the backoff
    wedge_kill_after: float | None = None  # kill a wedged daemon without clients after this


@dataclass(frozen=True)
class DaemonSnapshot:
    gpu: GpuUuid
    state: DaemonState
    pid: int | None
    restarts: int
    failures: int  # consecutive, drives the backoff
    backoff: float  # the last delay chosen, seconds
    last_probe_latency: float | None
    last_error: str | None
    settings: MpsSettings | None  # what the running daemon was started with, when known
    settings_pending: bool  # config differs; restart waits for zero clients
    tenant_mode: TenantMode


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """1 s, 2 s, 4 s … capped: the delay before attempt number `failures` + 1."""
    return float(min(cap, base * 2 ** max(0, failures - 1)))


def desired_settings(plan: GpuPlan, mps: MpsConfig, multiuser: bool) -> MpsSettings:
    return MpsSettings(
        pinned_limit_mib=plan.usable // MIB,
        # None = proportional: the per-container variable lowers it, the daemon stays at 100.
        active_thread_percentage=mps.active_thread_percentage or 100,
        protocol_version=mps.protocol_version,
        multiuser=multiuser,
    )


class _Worker:
    """One GPU's daemon; all mutation happens on its own thread except `stop`/`kick`."""

    def __init__(self, sup: MpsSupervisor, plan: GpuPlan) -> None:
        self.sup = sup
        self.gpu = plan.uuid
        self.plan = plan
        self.ctl = MpsControl(sup.mps_config().control_binary, sup.root, plan.uuid)
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.wake = threading.Event()
        self.halt = threading.Event()
        self.thread: threading.Thread | None = None
        self.state = DaemonState.STARTING
        self.pid: int | None = None
        self.settings: MpsSettings | None = None
        self.settings_pending = False
        self.compute_mode_set = False
        self.started_at = 0.0
        self.restarts = 0
        self.failures = 0
        self.backoff = 0.0
        self.next_attempt = 0.0
        self.ready_since: float | None = None
        self.wedged_since: float | None = None
        self.last_latency: float | None = None
        self.last_error: str | None = None
        self.last_clients = 0
        self.ever_started = False
        self.tenants = TenantWatch(layout.control_log(sup.root, plan.uuid))

    # --- lifecycle ---

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name=f"mps-{self.gpu}", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        self.halt.set()
        self.wake.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        self.thread = None

    def kick(self) -> None:
        with self.lock:
            if self.state is DaemonState.BACKOFF:
                return  # an Allocate does not shorten the backoff
        self.wake.set()

    def _loop(self) -> None:
        while not self.halt.is_set():
            try:
                self._step()
            except Exception as exc:  # keep supervising whatever happens
                logs.log(
                    _log, "mps worker error", level=logging.ERROR, gpu=self.gpu, error=repr(exc)
                )
                self._fail(f"internal-error {exc}")
            self.wake.wait(self._sleep_for())
            self.wake.clear()

    def _sleep_for(self) -> float:
        timing = self.sup.timing
        if self.state in (DaemonState.BACKOFF, DaemonState.STARTING):
            return max(0.0, min(timing.probe_interval, self.next_attempt - self.sup.clock()))
        return timing.probe_interval

    def _step(self) -> None:
        if self.state in (DaemonState.STARTING, DaemonState.BACKOFF):
            if self.sup.clock() >= self.next_attempt:
                self._bring_up()
        else:
            self._probe()

    # --- bring-up: adopt or start ---

    def _bring_up(self) -> None:
        settings = self.sup.settings_for(self.plan)
        try:
            layout.prepare(self.sup.root, self.gpu)
            pid = layout.read_pid(self.sup.root, self.gpu)
            if pid is not None and pid_alive(pid):
                if self._adopt(pid, settings):
                    return
            else:
                removed = layout.clean_pipe_dir(self.sup.root, self.gpu)
                if removed:
                    logs.log(_log, "mps stale files removed", gpu=self.gpu, files=",".join(removed))
            self._start_fresh(settings)
        except (ControlError, LayoutError, OSError) as exc:
            self._fail(f"start-failed {exc}")

    def _adopt(self, pid: int, wanted: MpsSettings) -> bool:
        """Take over a live daemon; False when it was quit so a fresh one can start."""
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
                self._quit(pid)
                return False
            logs.log(
                _log,
                "mps daemon kept: settings differ but it has clients",
                level=logging.WARNING,
                gpu=self.gpu,
                pid=pid,
                clients=clients,
            )
        self.compute_mode_set = marker.compute_mode_set if marker is not None else False
        with self.lock:
            self.ever_started = True
            self.settings = known
            self.settings_pending = not same
        logs.log(_log, "mps daemon adopted", gpu=self.gpu, pid=pid)
        self._became_ready(pid, marker.started_at if marker else self.sup.clock())
        return True

    def _start_fresh(self, settings: MpsSettings) -> None:
        mps = self.sup.mps_config()
        timeout = self.sup.timing.command_timeout
        marker = layout.read_marker(self.sup.root, self.gpu)
        self.compute_mode_set = marker.compute_mode_set if marker is not None else False
        if self.sup.set_exclusive(self.gpu):
            self.compute_mode_set = True
        layout.clean_pipe_dir(self.sup.root, self.gpu)
        launcher = self.sup.launcher_for(mps)
        try:
            self.ctl.start(
                protocol_version=mps.protocol_version,
                multiuser=settings.multiuser,
                timeout=timeout,
                launcher=launcher,
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
            settings = self.sup.settings_for(self.plan)
            layout.clean_pipe_dir(self.sup.root, self.gpu)
            self.ctl.start(
                protocol_version=mps.protocol_version,
                multiuser=False,
                timeout=timeout,
                launcher=launcher,
            )
        pid = self._wait_pid()
        self.ctl.set_defaults(settings.pinned_limit_mib, settings.active_thread_percentage, timeout)
        pinned, atp = self.ctl.read_defaults(timeout)
        if not mem_limit_matches(pinned, settings.pinned_limit_mib) or atp != float(
            settings.active_thread_percentage
        ):
            raise ControlError(
                f"gpu={self.gpu} defaults not applied: pinned={pinned}MiB atp={atp} "
                f"wanted {settings.pinned_limit_mib}MiB/{settings.active_thread_percentage}"
            )
        now = self.sup.clock()
        layout.write_marker(
            self.sup.root,
            self.gpu,
            DaemonMarker(pid, settings, self.compute_mode_set, time.time()),
        )
        with self.lock:
            self.settings = settings
            self.settings_pending = False
            if self.ever_started:
                self.restarts += 1
            self.ever_started = True
        logs.log(
            _log,
            "mps daemon started",
            gpu=self.gpu,
            pid=pid,
            pinned_mib=settings.pinned_limit_mib,
            active_thread_percentage=settings.active_thread_percentage,
            protocol=settings.protocol_version,
            tenants=self.sup.tenant_mode().value,
            launcher=launcher.name,
        )
        self._became_ready(pid, now)

    def _wait_pid(self) -> int:
        deadline = time.monotonic() + self.sup.timing.command_timeout
        while time.monotonic() < deadline:
            pid = layout.read_pid(self.sup.root, self.gpu)
            if pid is not None and pid_alive(pid):
                return pid
            time.sleep(0.02)
        raise ControlError(f"gpu={self.gpu} daemon wrote no live pid file")

    def _quit(self, pid: int) -> None:
        self.ctl.quit(self.sup.timing.command_timeout)
        deadline = time.monotonic() + self.sup.timing.command_timeout
        while pid_alive(pid):
            if time.monotonic() > deadline:
                raise ControlError(f"gpu={self.gpu} daemon {pid} did not exit after quit")
            time.sleep(0.02)

    def _became_ready(self, pid: int, started_at: float) -> None:
        with self.lock:
            self.pid = pid
            self.state = DaemonState.READY
            self.ready_since = self.sup.clock()
            self.wedged_since = None
            self.started_at = started_at
            self.last_error = None
        self.sup.board.clear(self.gpu, FaultDomain.MPS_DAEMON)
        self.ready.set()
        self._probe()

    # --- failures and backoff ---

    def _fail(self, cause: str) -> None:
        now = self.sup.clock()
        timing = self.sup.timing
        with self.lock:
            if self.ready_since is not None and now - self.ready_since >= timing.stable_reset:
                self.failures = 0
            self.failures += 1
            self.backoff = backoff_delay(self.failures, timing.backoff_base, timing.backoff_max)
            self.next_attempt = now + self.backoff
            self.state = DaemonState.BACKOFF
            self.ready_since = None
            self.last_error = cause
        self.ready.clear()
        self.sup.board.set(self.gpu, FaultDomain.MPS_DAEMON, cause)
        logs.log(
            _log,
            "mps daemon down",
            level=logging.WARNING,
            gpu=self.gpu,
            cause=cause,
            retry_in=self.backoff,
        )

    # --- liveness ---

    def _probe(self) -> None:
        pid = self.pid
        if pid is None or not pid_alive(pid):
            self.sup.board.clear(self.gpu, FaultDomain.MPS_SERVER)
            self._fail(f"daemon-dead pid={pid}")
            return
        timeout = self.sup.timing.probe_timeout
        t0 = time.monotonic()
        try:
            servers = self.ctl.server_list(timeout)
            states = self.ctl.server_statuses(servers, timeout)
        except ControlError as exc:
            self._wedged(pid, exc)
            return
        with self.lock:
            self.last_latency = time.monotonic() - t0
            if self.state is DaemonState.WEDGED:
                logs.log(_log, "mps daemon answers again", gpu=self.gpu, pid=pid)
                self.state = DaemonState.READY
                self.ready_since = self.sup.clock()
                self.wedged_since = None
                self.last_error = None
        self.sup.board.clear(self.gpu, FaultDomain.MPS_DAEMON)
        self.ready.set()
        self._server_health(states)
        if self.settings_pending:
            self._restart_if_idle(pid, servers)

    def _wedged(self, pid: int, exc: ControlError) -> None:
        if not pid_alive(pid):
            self._fail(f"daemon-dead pid={pid}")
            return
        kind = "daemon-wedged" if isinstance(exc, ControlTimeout) else "daemon-unreachable"
        now = self.sup.clock()
        with self.lock:
            first = self.state is not DaemonState.WEDGED
            if first:
                self.wedged_since = now
            self.state = DaemonState.WEDGED
            self.last_error = f"{kind} pid={pid}"
            wedged_for = now - (self.wedged_since or now)
        self.ready.clear()
        self.sup.board.set(self.gpu, FaultDomain.MPS_DAEMON, f"{kind} pid={pid}")
        if first:
            logs.log(
                _log,
                "mps daemon not answering",
                level=logging.WARNING,
                gpu=self.gpu,
                pid=pid,
                error=str(exc),
            )
        limit = self.sup.timing.wedge_kill_after
        if limit is not None and wedged_for >= limit and self.last_clients == 0:
            # Only a daemon that had no clients at its last answer; SIGKILL works on a stopped one.
            logs.log(_log, "mps wedged daemon killed", level=logging.WARNING, gpu=self.gpu, pid=pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _server_health(self, states: dict[int, ServerState]) -> None:
        causes = [
            f"mps-state=FAULT server={p}" for p, s in states.items() if s is ServerState.FAULT
        ]
        if self.sup.tenant_mode() is TenantMode.SINGLE_UID:
            self.tenants.poll()
            waiting = self.tenants.waiting_uids()
            if waiting:
                serving = ",".join(str(u) for u in sorted(self.tenants.server_uids()))
                blocked = ",".join(str(u) for u in sorted(waiting))
                causes.append(f"uid-conflict serving={serving} waiting={blocked}")
        if causes:
            if self.sup.board.set(self.gpu, FaultDomain.MPS_SERVER, "; ".join(causes)):
                logs.log(
                    _log,
                    "mps server unhealthy",
                    level=logging.WARNING,
                    gpu=self.gpu,
                    cause=causes[0],
                )
        elif self._own_server_fault() and self.sup.board.clear(self.gpu, FaultDomain.MPS_SERVER):
            logs.log(_log, "mps server healthy", gpu=self.gpu)

    def _own_server_fault(self) -> bool:
        """Only faults this probe set are its to clear; an application Xid's belongs to the
        health monitor, which clears it once the server is ACTIVE again after the Xid."""
        fault = self.sup.board.faults(self.gpu).get(FaultDomain.MPS_SERVER)
        return fault is not None and fault.cause.startswith(("mps-state=", "uid-conflict"))

    def _restart_if_idle(self, pid: int, servers: list[int]) -> None:
        timeout = self.sup.timing.probe_timeout
        try:
            clients = self.ctl.client_count(servers, timeout)
        except ControlError:
            return  # the next probe decides
        self.last_clients = clients
        if clients:
            return
        logs.log(_log, "mps daemon restart: settings differ, no clients", gpu=self.gpu, pid=pid)
        try:
            self._quit(pid)
        except ControlError as exc:
            self._fail(f"restart-failed {exc}")
            return
        with self.lock:
            self.state = DaemonState.STARTING
            self.next_attempt = 0.0
        self.ready.clear()
        self.sup.board.set(self.gpu, FaultDomain.MPS_DAEMON, "daemon-restarting settings-changed")
        self._bring_up()

    def update(self, plan: GpuPlan) -> None:
        """A new plan for this GPU: different settings restart the daemon once it is idle."""
        self.plan = plan
        wanted = self.sup.settings_for(plan)
        with self.lock:
            if self.settings is not None and self.settings != wanted:
                self.settings_pending = True
        self.wake.set()

    def snapshot(self) -> DaemonSnapshot:
        with self.lock:
            return DaemonSnapshot(
                gpu=self.gpu,
                state=self.state,
                pid=self.pid,
                restarts=self.restarts,
                failures=self.failures,
                backoff=self.backoff,
                last_probe_latency=self.last_latency,
                last_error=self.last_error,
                settings=self.settings,
                settings_pending=self.settings_pending,
                tenant_mode=self.sup.tenant_mode(),
            )


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
        launcher_for: Callable[[MpsConfig], Launcher] = launch.from_config,
    ) -> None:
        """`multiuser` None = auto: `-multiuser-server` when root, falling back if refused.
        `launcher_for` turns the current `mps` config into the launcher of the next start."""
        self.root = mps_root
        self.config_source = config_source
        self.board = board
        self.compute_modes = compute_modes
        self.clock = clock
        self.timing = timing or Timing()
        self.multiuser_auto = multiuser is None
        self.launcher_for = launcher_for
        self._multiuser = os.geteuid() == 0 if multiuser is None else multiuser
        self._lock = threading.Lock()
        self._workers: dict[GpuUuid, _Worker] = {}
        self._started = False

    # --- configuration ---

    def mps_config(self) -> MpsConfig:
        return self.config_source().mps

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
            fresh: list[_Worker] = []
            for gpu, gpu_plan in wanted.items():
                existing = self._workers.get(gpu)
                if existing is None:
                    self._workers[gpu] = _Worker(self, gpu_plan)
                    fresh.append(self._workers[gpu])
                else:
                    existing.update(gpu_plan)
            started = self._started
        for worker in fresh:
            self.board.set(worker.gpu, FaultDomain.MPS_DAEMON, "daemon-starting")
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
