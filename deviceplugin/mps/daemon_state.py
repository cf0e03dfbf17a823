"""The data a GPU's MPS daemon worker shares with the supervisor, and the rules it follows.

`DaemonState` and `DaemonSnapshot` are what the worker (worker.py) reports, `Timing` is the
pacing the supervisor gives it; `desired_settings` (the daemon settings a GPU's plan asks for)
and `backoff_delay` are pure. Data and rules only, apart from the worker's thread and its
process control.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from deviceplugin.config.settings import Config, MpsConfig
from deviceplugin.health.board import HealthBoard
from deviceplugin.model import MIB, GpuUuid
from deviceplugin.mps.control import ServerState
from deviceplugin.mps.launch import Launcher
from deviceplugin.mps.layout import MpsSettings
from deviceplugin.mps.shm import ShmState
from deviceplugin.mps.tenants import TenantMode
from deviceplugin.plan import GpuPlan
from deviceplugin.plumbing.exits import ExitWatch


class DaemonState(StrEnum):
    STARTING = "starting"  # first bring-up pending or running
    READY = "ready"  # probe passes
    BACKOFF = "backoff"  # dead or failed to start; next attempt at `next_attempt`
    WEDGED = "wedged"  # alive but not answering in time
    STOPPED = "stopped"


@dataclass(frozen=True)
class Timing:
    """Probe and restart pacing; tests shrink these. None: the value from the `mps` config."""

    probe_interval: float | None = None  # mps.probeInterval
    probe_failures: int | None = None  # mps.probeFailures
    probe_timeout: float = 5.0
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
    memory_accounting: bool = False  # protocol 3 and the readback after start said `on`
    server_states: dict[int, ServerState] | None = None  # the last probe's; None: unknown
    probed_at: float | None = None  # when the last answered probe started (supervisor clock)


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """1 s, 2 s, 4 s … capped: the delay before attempt number `failures` + 1."""
    return float(min(cap, base * 2 ** max(0, failures - 1)))


def desired_settings(plan: GpuPlan, mps: MpsConfig, multiuser: bool) -> MpsSettings:
    # The daemon default is the most a client can raise its own pinned limit to: by default
    # the largest share one container can be granted here (the usable memory), lower when
    # mps.defaultPinnedMemoryLimit says so (never above the usable memory).
    pinned = plan.usable
    if mps.default_pinned_memory_limit is not None:
        pinned = min(pinned, mps.default_pinned_memory_limit)
    return MpsSettings(
        pinned_limit_mib=pinned // MIB,
        # None = proportional: the per-container variable lowers it, the daemon stays at 100.
        active_thread_percentage=mps.active_thread_percentage or 100,
        protocol_version=mps.protocol_version,
        multiuser=multiuser,
    )


class WorkerHost(Protocol):
    """What a GPU's worker and its steps read from the supervisor that owns them.

    `MpsSupervisor` is the one implementation; the worker holds it through this interface so
    that worker.py and daemon_steps.py sit below supervisor.py and never import it.
    """

    @property
    def root(self) -> Path: ...

    @property
    def board(self) -> HealthBoard: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def timing(self) -> Timing: ...

    @property
    def config_source(self) -> Callable[[], Config]: ...

    @property
    def launcher_for(self) -> Callable[[Config], Launcher]: ...

    @property
    def multiuser_auto(self) -> bool: ...

    @property
    def exit_watch(self) -> ExitWatch: ...

    def mps_config(self) -> MpsConfig: ...

    def probe_interval(self) -> float: ...

    def probe_failures(self) -> int: ...

    def shm_state(self, gpu: GpuUuid) -> ShmState: ...

    def shm_for(self, gpu: GpuUuid) -> Path | None: ...

    def tenant_mode(self) -> TenantMode: ...

    def multiuser_failed(self) -> None: ...

    def settings_for(self, plan: GpuPlan) -> MpsSettings: ...

    def set_exclusive(self, gpu: GpuUuid) -> bool: ...
