"""HealthMonitor: NVML events and periodic probes turned into fault domains on the HealthBoard.

An event thread waits on one NVML event set (Xid, double-bit ECC, GPU unavailable, recovery
action); a probe thread notices lost and returned GPUs, reads the recovery action, consumes
operator clears and ends quiet periods. Faults map to domains per DESIGN section 5 and clear
again; if monitoring cannot run, every GPU carries a MONITOR fault (fail closed). The fault
records and their transitions are a FaultBook (faults.py), the event thread and its
event set an EventWatch (events.py); this module holds the monitor, its probe thread
and `health.json`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deviceplugin.config.settings import Config
from deviceplugin.health import state as health_state
from deviceplugin.health.board import HealthBoard, device_health
from deviceplugin.health.events import EventWatch, answers, read_action
from deviceplugin.health.faults import FaultBook, MpsServerActive, Transition
from deviceplugin.health.xid import (
    RECOVERY_NONE,
    XidClass,
    recovery_action_class,
    recovery_action_name,
)
from deviceplugin.inventory.nvml import NvmlSession
from deviceplugin.model import FaultDomain, GpuUuid
from deviceplugin.plan import SlicePlan
from deviceplugin.plumbing import logs

_log = logs.get("health")


class HealthMonitor:
    """Owns the event and probe threads; `start()`/`stop()` are idempotent.

    Board updates happen under the monitor's lock, so board listeners must not block.
    `mps_server_active` is asked whether an sm-sharing GPU's MPS server is ACTIVE again after
    an application Xid; it is trusted only `mps_settle` seconds after the Xid, so a probe
    taken before the fault cannot clear it.
    """

    def __init__(
        self,
        session: NvmlSession,
        plan_source: Callable[[], SlicePlan],
        config_source: Callable[[], Config],
        board: HealthBoard,
        state_dir: Path,
        *,
        mps_server_active: MpsServerActive | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        probe_interval: float = 1.0,
        on_transition: Callable[[Transition], None] | None = None,
        wait_timeout: float = 1.0,
        mps_settle: float = 2.0,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
    ) -> None:
        self.session = session
        self.plan_source = plan_source
        self.config_source = config_source
        self.board = board
        self.state_dir = state_dir
        self.clock = clock
        self.wall = wall
        self.probe_interval = probe_interval

        self._lock = threading.RLock()
        self._tick_lock = threading.Lock()
        self._halt = threading.Event()
        self._dirty = threading.Event()
        self._threads: list[threading.Thread] = []
        self._unsubscribe: Callable[[], None] | None = None
        self._started = False

        self._faults = FaultBook(
            board,
            plan_source,
            self._lock,
            self._dirty,
            clock=clock,
            wall=wall,
            on_transition=on_transition,
            mps_server_active=mps_server_active,
            mps_settle=mps_settle,
        )
        self._events = EventWatch(
            session,
            plan_source,
            config_source,
            self._faults,
            self._lock,
            self._halt,
            wait_timeout=wait_timeout,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
        )

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Build the event set now (MONITOR faults if it fails), then start the threads."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._halt.clear()
        self._unsubscribe = self.board.subscribe(self._dirty.set)
        self._mark_lost_at_start()
        self._events.open_events()
        self.tick()  # lost GPUs and pending recovery actions count before anyone reads health
        self._write_state()
        for name, target in (
            ("health-events", self._events.run),
            ("health-probe", self._probe_loop),
            ("health-state", self._state_loop),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        logs.log(_log, "health monitor started", gpus=len(self.session.handles()))

    def stop(self) -> None:
        with self._lock:
            if not self._started:
                return
            self._started = False
        self._halt.set()
        self._dirty.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        self._threads.clear()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._events.close_events()
        self._write_state(running=False)
        logs.log(_log, "health monitor stopped")

    def registered_gpus(self) -> frozenset[GpuUuid]:
        """GPUs whose events the current event set delivers."""
        return self._events.registered_gpus()

    @property
    def events_seen(self) -> int:
        """Events the event thread has handled; tests wait on these counters."""
        return self._events.events_seen

    @property
    def event_sets_opened(self) -> int:
        return self._events.event_sets_opened

    @property
    def running(self) -> bool:
        return all(t.is_alive() for t in self._threads) and bool(self._threads)

    # ---- probe thread ---------------------------------------------------------------------

    def _probe_loop(self) -> None:
        while not self._halt.wait(self.probe_interval):
            try:
                self.tick()
            except Exception as exc:  # a failed probe round must not end the probing
                logs.log(_log, "health probe error", level=logging.ERROR, error=repr(exc))

    def tick(self) -> None:
        """One probe round: operator clears, lost/returned GPUs, recovery, MPS faults."""
        with self._tick_lock:
            self._consume_clears()
            quiet = self.config_source().health.quiet_period
            for uuid in self.session.handles():
                self._probe_gpu(uuid, quiet)
            self._faults.check_app_faults()

    def _consume_clears(self) -> None:
        try:
            requests = health_state.take_clears(self.state_dir)
        except OSError as err:
            logs.log(_log, "clear requests unreadable", level=logging.WARNING, error=str(err))
            return
        for uuid in requests:
            # A failed read is (False, None): no action for the clear to accept.
            action = (
                read_action(self.session, uuid)[1] if self._faults.has_gpu_fault(uuid) else None
            )
            accepted = self._faults.operator_clear(uuid, action)
            logs.log(
                _log,
                "operator clear",
                gpu=uuid,
                result="accepted" if accepted else "no-gpu-fault",
            )

    def _probe_gpu(self, uuid: GpuUuid, quiet: float) -> None:
        if not answers(self.session, uuid):
            self._faults.gpu_fault(uuid, "gpu-lost", XidClass.REBOOT)
            self._events.lost(uuid)
            return
        self._events.returned(uuid)
        ok, action = read_action(self.session, uuid)
        # The GPU answered above, so a failed read is no value, never a reason to stop here:
        # an operator's clear must still apply.
        action = self._faults.unacknowledged(uuid, action) if ok else None
        if action is not None and action != RECOVERY_NONE:
            cls = recovery_action_class(action) or XidClass.RESET
            self._faults.gpu_fault(
                uuid, f"recovery-action={recovery_action_name(action)} class={cls}", cls
            )
            return
        self._faults.maybe_recover(uuid, action, quiet)

    def _mark_lost_at_start(self) -> None:
        # GPUs lost before their UUID could be read have no handle to probe: faulted for good.
        for gp in self.plan_source().gpus:
            if gp.gpu.lost and gp.uuid not in self.session.handles():
                self._faults.gpu_fault(gp.uuid, "gpu-lost at-start", XidClass.REBOOT)

    # ---- state file -----------------------------------------------------------------------

    def _state_loop(self) -> None:
        while not self._halt.is_set():
            self._dirty.wait()
            if self._halt.is_set():
                return
            self._dirty.clear()
            self._write_state()

    def state(self, running: bool = True) -> dict[str, Any]:
        """What `health.json` holds: per GPU its mode, health and faults with cause and since."""
        now, wall = self.clock(), self.wall()
        quiet = self.config_source().health.quiet_period
        plan = self.plan_source()
        snapshot = self.board.snapshot()
        phases = self._faults.phases()
        gpus: dict[str, Any] = {}
        uuids = dict.fromkeys([*(p.uuid for p in plan.gpus), *snapshot])
        for uuid in uuids:
            gp = plan.for_gpu(uuid)
            faults = snapshot.get(uuid, {})
            entries: dict[str, Any] = {}
            for domain, fault in faults.items():
                entry: dict[str, Any] = {"cause": fault.cause, "since": fault.since}
                if domain is FaultDomain.GPU and uuid in phases:
                    phase, since = phases[uuid]
                    entry["phase"] = phase.value
                    if since is not None:
                        entry["quietUntil"] = wall + max(0.0, since + quiet - now)
                entries[domain.value] = entry
            gpus[uuid] = {
                "index": gp.gpu.index if gp is not None else None,
                "mode": gp.mode.value if gp is not None else None,
                "health": device_health(gp.mode, faults, allocated=False).value
                if gp is not None
                else None,
                "faults": entries,
            }
        return {
            "version": health_state.STATE_VERSION,
            "updatedAt": wall,
            "monitor": {"running": running, "pid": os.getpid()},
            "gpus": gpus,
        }

    def _write_state(self, running: bool = True) -> None:
        try:
            health_state.write_health(self.state_dir, self.state(running))
        except OSError as err:
            logs.log(_log, "health state write failed", level=logging.WARNING, error=str(err))
