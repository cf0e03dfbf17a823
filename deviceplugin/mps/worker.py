"""One GPU's MPS control daemon, kept by its own thread: bring-up, liveness, log cap.

`DaemonWorker` starts or adopts the daemon (settings set and read back, memory accounting
proven for protocol 3), watches its exit through a pidfd (its domain is down the moment it
dies, whatever the probe interval), probes it every `mps.probeInterval` (one control-client
run, 5 s timeout; `mps.probeFailures` failures in a row make a wedge, a dead pid counts at
once), keeps its logs under `mps.maxLogBytes` by truncating in place, and turns what it sees
into HealthBoard faults. `MpsSupervisor` (supervisor.py) owns one per sm-sharing GPU. The states,
snapshot and pacing it shares with the supervisor are in daemon_state.py; the steps that
adopt, start and quit the daemon (control client and files, no worker state) in
daemon_steps.py. Over 400 lines on purpose: the thread, its state machine and the fields its
one lock guards read as one piece; what can stand apart already does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from deviceplugin.model import FaultDomain
from deviceplugin.mps import layout
from deviceplugin.mps.control import ControlError, ControlTimeout, MpsControl, ServerState
from deviceplugin.mps.daemon_state import DaemonSnapshot, DaemonState, WorkerHost, backoff_delay
from deviceplugin.mps.daemon_steps import DaemonSteps
from deviceplugin.mps.layout import LayoutError, MpsSettings
from deviceplugin.mps.tenants import TenantMode, TenantWatch
from deviceplugin.plan import GpuPlan
from deviceplugin.plumbing import logs
from deviceplugin.plumbing.exits import PidFd
from deviceplugin.plumbing.process import pid_alive

_log = logs.get("mps")


class DaemonWorker:
    """One GPU's daemon; all mutation happens on its own thread except `stop`/`kick`."""

    def __init__(self, sup: WorkerHost, plan: GpuPlan) -> None:
        self.sup = sup
        self.gpu = plan.uuid
        self.plan = plan
        self.ctl = MpsControl(sup.mps_config().control_binary, sup.root, plan.uuid)
        self.steps = DaemonSteps(sup, plan.uuid, self.ctl)
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.wake = threading.Event()
        self.halt = threading.Event()
        self.thread: threading.Thread | None = None
        self.state = DaemonState.STARTING
        self.pid: int | None = None
        self.settings: MpsSettings | None = None
        self.settings_pending = False
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
        self.probe_failures = 0  # in a row
        self.probes = 0  # answered probes, for tests and metrics
        self.servers: list[int] = []  # the last probe's list; their states are asked next
        self.server_states: dict[int, ServerState] | None = None
        self.probed_at: float | None = None
        self.memory_accounting = False
        self.unrecognised: set[str] = set()  # status lines logged verbatim (once each)
        self.exited: int | None = None  # the pid its exit watch saw exit (any thread sets it)
        self._unwatch: Callable[[], None] | None = None  # cancels the exit watch

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
        self._disarm()

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
        interval = self.sup.probe_interval()
        if self.state in (DaemonState.BACKOFF, DaemonState.STARTING):
            return max(0.0, min(interval, self.next_attempt - self.sup.clock()))
        return interval

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
                # Opened right after the pid was confirmed: a later reuse cannot fool it.
                if self._adopt(pid, settings, self.sup.exit_watch.open(pid)):
                    return
            else:
                removed = layout.clean_pipe_dir(self.sup.root, self.gpu)
                if removed:
                    logs.log(_log, "mps stale files removed", gpu=self.gpu, files=",".join(removed))
            self._start_fresh(settings)
        except (ControlError, LayoutError, OSError) as exc:
            self._fail(f"start-failed {exc}")

    def _adopt(self, pid: int, wanted: MpsSettings, pidfd: PidFd | None) -> bool:
        """Take over a live daemon; False when it was quit so a fresh one can start."""
        try:
            adopted = self.steps.adopt(pid, wanted)
        except BaseException:
            if pidfd is not None:
                pidfd.close()
            raise
        if adopted is None:
            if pidfd is not None:
                pidfd.close()
            return False
        marker = adopted.marker
        with self.lock:
            self.ever_started = True
            self.settings = adopted.settings
            self.settings_pending = adopted.settings_pending
            self.memory_accounting = adopted.memory_accounting
        logs.log(_log, "mps daemon adopted", gpu=self.gpu, pid=pid)
        self._became_ready(pid, marker.started_at if marker else self.sup.clock(), pidfd)
        return True

    def _start_fresh(self, settings: MpsSettings) -> None:
        started = self.steps.start(self.plan, settings)
        settings = started.settings
        with self.lock:
            self.settings = settings
            self.settings_pending = False
            self.memory_accounting = started.memory_accounting
            if self.ever_started:
                self.restarts += 1
            self.ever_started = True
        logs.log(
            _log,
            "mps daemon started",
            gpu=self.gpu,
            pid=started.pid,
            pinned_mib=settings.pinned_limit_mib,
            active_thread_percentage=settings.active_thread_percentage,
            protocol=settings.protocol_version,
            tenants=self.sup.tenant_mode().value,
            launcher=started.launcher.name,
            shm=self.sup.shm_state(self.gpu).value,
            memory_accounting=started.memory_accounting,
        )
        self._became_ready(started.pid, started.started_at, started.pidfd)

    def _became_ready(self, pid: int, started_at: float, pidfd: PidFd | None) -> None:
        with self.lock:
            self.exited = None
            self.probe_failures = 0
            self.servers = []
            self.server_states = None
            self.probed_at = None
            self.pid = pid
            self.state = DaemonState.READY
            self.ready_since = self.sup.clock()
            self.wedged_since = None
            self.started_at = started_at
            self.last_error = None
        self.sup.board.clear(self.gpu, FaultDomain.MPS_DAEMON)
        self.ready.set()
        self._arm(pid, pidfd)
        self._probe()

    # --- exit watch: a dead daemon's domain is down at once, not at the next probe ---

    def _arm(self, pid: int, pidfd: PidFd | None) -> None:
        self._disarm()
        if pidfd is not None:
            self._unwatch = self.sup.exit_watch.watch(pidfd, lambda: self._exited(pid))

    def _disarm(self) -> None:
        unwatch, self._unwatch = self._unwatch, None
        if unwatch is not None:
            unwatch()

    def _exited(self, pid: int) -> None:
        """On the watch's thread: the daemon `pid` exited. Its fault goes up now, with the
        cause a probe gives a dead pid; the worker's thread, woken instead of waiting out the
        probe interval, then takes the probe's path (backoff, restart)."""
        with self.lock:
            if self.pid != pid or self.state not in (DaemonState.READY, DaemonState.WEDGED):
                return
            self.exited = pid
        self.ready.clear()
        self.sup.board.set(self.gpu, FaultDomain.MPS_DAEMON, f"daemon-dead pid={pid}")
        self.wake.set()

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
        self._disarm()
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
        if pid is None or self.exited == pid or not pid_alive(pid):
            self._dead(pid)
            return
        timeout = self.sup.timing.probe_timeout
        t0 = time.monotonic()
        started = self.sup.clock()
        try:
            # One run of the control client: the list, and the states of the last list's
            # servers (a server new in this list is asked about next time).
            probe = self.ctl.probe(self.servers, timeout)
        except ControlError as exc:
            self.probe_failures += 1
            if (
                self.probe_failures >= self.sup.probe_failures()
                or self.exited == pid
                or not pid_alive(pid)
            ):
                self._wedged(pid, exc)
            else:
                logs.log(
                    _log,
                    "mps probe failed",
                    level=logging.WARNING,
                    gpu=self.gpu,
                    pid=pid,
                    in_a_row=self.probe_failures,
                    error=str(exc),
                )
            return
        self.probe_failures = 0
        self.probes += 1
        servers = probe.servers
        listed = set(servers)
        states = {p: s for p, s in probe.states.items() if p in listed}
        self._log_unrecognised(probe.raw, states)
        known = listed <= set(states)
        with self.lock:
            dead = self.exited == pid  # it exited while this probe ran: the answer is stale
            if not dead:
                self.servers = servers
                self.server_states = dict(states) if known else None
                self.probed_at = started
                self.last_latency = time.monotonic() - t0
            if not dead and self.state is DaemonState.WEDGED:
                logs.log(_log, "mps daemon answers again", gpu=self.gpu, pid=pid)
                self.state = DaemonState.READY
                self.ready_since = self.sup.clock()
                self.wedged_since = None
                self.last_error = None
        if dead:
            self._dead(pid)
            return
        self.sup.board.clear(self.gpu, FaultDomain.MPS_DAEMON)
        self.ready.set()
        certain = known and ServerState.UNKNOWN not in states.values()
        self._server_health(states, certain)
        self._cap_logs()
        if self.settings_pending:
            self._restart_if_idle(pid, servers)

    def _dead(self, pid: int | None) -> None:
        # The daemon's fault first, then its servers' (the domain is never Healthy between).
        self._fail(f"daemon-dead pid={pid}")
        self.sup.board.clear(self.gpu, FaultDomain.MPS_SERVER)

    def _log_unrecognised(self, raw: dict[int, str], states: dict[int, ServerState]) -> None:
        for pid, state in states.items():
            text = raw.get(pid, "")
            if state is ServerState.UNKNOWN and text not in self.unrecognised:
                self.unrecognised.add(text)
                logs.log(
                    _log,
                    "mps server status not recognised; fault kept",
                    level=logging.WARNING,
                    gpu=self.gpu,
                    server=pid,
                    output=repr(text),
                )

    def _cap_logs(self) -> None:
        """Keep the GPU's daemon logs under mps.maxLogBytes: truncate in place, never rename
        (the daemon appends through the file it has open). control.log is read first, so
        the tenant watch misses no line."""
        limit = self.sup.mps_config().max_log_bytes
        try:
            files = [f for f in layout.log_dir(self.sup.root, self.gpu).iterdir() if f.is_file()]
            total = sum(f.stat().st_size for f in files)
        except OSError:
            return
        if total < limit:
            return
        self.tenants.poll()
        for path in files:
            try:
                os.truncate(path, 0)
            except OSError as exc:
                logs.log(_log, "mps log not truncated", level=logging.WARNING, gpu=self.gpu,
                         file=path.name, error=str(exc))  # fmt: skip
        self.tenants.rewound()
        logs.log(_log, "mps logs truncated", gpu=self.gpu, bytes=total, limit=limit)

    def _wedged(self, pid: int, exc: ControlError) -> None:
        if self.exited == pid or not pid_alive(pid):
            self._dead(pid)
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

    def _server_health(self, states: dict[int, ServerState], certain: bool = True) -> None:
        """Set or clear this supervisor's MPS_SERVER fault; it is cleared only when every
        listed server was asked about and answered a known state (`certain`)."""
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
        elif (
            certain
            and self._own_server_fault()
            and self.sup.board.clear(self.gpu, FaultDomain.MPS_SERVER)
        ):
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
        self._disarm()  # this exit is ours, not a fault
        try:
            self.steps.quit(pid)
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
                memory_accounting=self.memory_accounting,
                server_states=None if self.server_states is None else dict(self.server_states),
                probed_at=self.probed_at,
            )
