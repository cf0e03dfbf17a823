"""The node agent's lifecycle: wires the parts, runs them, reloads, and stops them in order.

`Daemon.run()` loads config and inventory, builds the plan, starts the MPS supervisor, the
health monitor, the Kubernetes integration, metrics and one gRPC server per resource, then
waits for SIGTERM/SIGINT (clean stop) or SIGHUP / a config file change (reload).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from deviceplugin import config as config_mod
from deviceplugin import fsutil, logs
from deviceplugin.afterreply import after_reply
from deviceplugin.allocator import Allocator, Grant, largest_free
from deviceplugin.cdi_registry import DriverDeviceWatch, driver_devices
from deviceplugin.config import (
    CdiConfig,
    Config,
    ConfigError,
    with_control_binary,
    with_spec_dirs,
)
from deviceplugin.dpapi.feed import DeviceFeed
from deviceplugin.dpapi.podresources import ContainerDevices, PodResourcesClient, PodResourcesPoller
from deviceplugin.dpapi.registry import PluginSet
from deviceplugin.dpapi.server import DevicePluginService
from deviceplugin.flags import DEFAULT_KUBELET_PLUGINS_DIR, DEFAULT_KUBELET_REGISTRY_DIR
from deviceplugin.healthboard import HealthBoard, device_health
from deviceplugin.inventory import Inventory, NodeFacts, read_inventory
from deviceplugin.inventory_cache import with_remembered
from deviceplugin.ledger import Ledger
from deviceplugin.metrics import AllocationMemory, PluginMetrics, SliceCount
from deviceplugin.metrics_server import MetricsServer
from deviceplugin.model import MIB, GpuUuid, Mode, ResourceName
from deviceplugin.mps import shm
from deviceplugin.mps.layout import LayoutError
from deviceplugin.mps.shm import ShmState
from deviceplugin.mps.supervisor import MpsSupervisor
from deviceplugin.nvml import NvmlSession
from deviceplugin.plan import (
    SlicePlan,
    build_plan,
    merge_reload,
    missing_driver_devices,
    serving_none_message,
    skip_gpus,
    validate_against,
)
from deviceplugin.preferred import preferred
from deviceplugin.replay import restore_cdi_specs

LOG = logs.get("daemon")
STOP_TIMEOUT = 4.0
# The event loop answers the kubelet; the other threads (health, MPS, status writer, API
# watches) run Python in bursts. A thread wanting the GIL waits up to this long before the
# holder is asked to drop it (Python's default: 5 ms, a whole Allocate budget many times over).
SWITCH_INTERVAL = 0.001
# Writes (seen when the file is closed), creations, renames and deletions: what a ConfigMap
# update or an edit does. Asked of the kernel, so neither our own reads of the config nor
# writes to other files of its directory (a log beside it) wake the watch's threads.
CONFIG_EVENTS = (FileCreatedEvent, FileClosedEvent, FileMovedEvent, FileDeletedEvent)


def freeze_heap() -> None:
    """Move what startup (or a reload) built, the plan's thousands of slice IDs above all,
    out of the garbage collector's sight: a full collection of that heap paused the event
    loop 25 ms (an Allocate's whole p99 budget many times over), and every later collection
    walked it again. What a reload makes garbage is unfrozen and collected first."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _name(path: str | bytes) -> str:
    return Path(path.decode() if isinstance(path, bytes) else path).name


class StartupError(Exception):
    """A runtime failure before serving (exit 1)."""


@dataclass(frozen=True)
class RunOptions:
    config_path: Path | None
    kubelet_dir: Path
    pod_resources_socket: Path
    state_dir: Path
    mps_root: Path
    cdi_dir: Path
    sysfs_root: Path
    node_name: str | None
    metrics_address: str
    environ: Mapping[str, str] = field(default_factory=dict)
    host_root: Path = Path("/")
    kubelet_plugins_dir: Path = Path(DEFAULT_KUBELET_PLUGINS_DIR)
    kubelet_registry_dir: Path = Path(DEFAULT_KUBELET_REGISTRY_DIR)


@dataclass
class Platform:
    """What differs between a real node and a simulated one; the cli builds it.

    `node_facts` given: the simulation's spec (never the host's); `control_binary`: the MPS
    control binary to use instead of config's; `extras`: parts started after the daemon's own
    and stopped before them (the fault injector).
    """

    sysfs_root: Path | None = None
    node_facts: NodeFacts | None = None
    control_binary: str | None = None
    set_up: Callable[[Config], None] | None = None
    extras: Sequence[Any] = ()
    # The simulated node's CDI spec directories, used while the config keeps the default.
    spec_dirs: tuple[str, ...] | None = None

    @property
    def simulated(self) -> bool:
        return self.node_facts is not None


def cause_class(cause: str) -> str:
    """A bounded metric label for a cause: `xid=79 class=reboot` → `reboot`, `daemon-dead
    pid=7` → `daemon-dead`, `mps-state=FAULT server=9` → `mps-state`."""
    for part in cause.split():
        if part.startswith("class="):
            return part.removeprefix("class=")
    return cause.split(" ", 1)[0].split("=", 1)[0] or "unknown"


def load_config(path: Path | None) -> Config:
    return Config() if path is None else config_mod.load(path)


def checked_plan(inventory: Inventory, config: Config) -> SlicePlan:
    errors, warnings = validate_against(config, inventory)
    for warning in warnings:
        logs.log(LOG, "config warning", level=logging.WARNING, problem=warning)
    if errors:
        raise ConfigError(errors)
    return build_plan(inventory, config)


def log_plan(plan: SlicePlan) -> None:
    for gp in plan.gpus:
        logs.log(
            LOG,
            "plan",
            gpu=gp.uuid,
            index=gp.gpu.index,
            mode=gp.mode.value,
            api=gp.api.value,
            resource=gp.resource,
            slices=len(gp.device_ids) if gp.advertised else 0,
            slice_mib=gp.slice_size // (1 << 20),
            enforcement=",".join(e.value for e in gp.enforcement) or "none",
            skipped=gp.skipped or "-",
        )


class AllocationService:
    """The gRPC servers' backend: the allocator plus latency and refusal bookkeeping."""

    def __init__(self, daemon: Daemon) -> None:
        self._d = daemon

    def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        return list(preferred(self._d.plan, resource, available, must_include, size))

    def allocate(self, resource: str, device_ids: Sequence[str]) -> Grant:
        grant = self._d.allocator.allocate(resource, device_ids)
        after_reply(self._d.after_allocate)  # it wakes the pod-resources poll
        return grant

    def wait_mps(self, gpu: GpuUuid, timeout: float) -> bool:
        return self._d.mps.wait_ready(gpu, timeout)


class DaemonObserver:
    """What the gRPC servers report: latencies and refusals to metrics, refusals to the pods."""

    def __init__(self, daemon: Daemon) -> None:
        self._d = daemon

    def allocate_latency(self, resource: str, seconds: float) -> None:
        self._d.metrics.allocate_latency(resource, seconds)

    def preferred_latency(self, resource: str, seconds: float) -> None:
        self._d.metrics.preferred_latency(resource, seconds)

    def refused(self, resource: str, reason: str, count: int = 0, message: str = "") -> None:
        self._d.metrics.refused(resource, reason)
        if self._d.kube is not None:
            used = self._d.ledger.used_ids(resource)
            fit, _ = largest_free(self._d.plan, self._d.board, used, resource)
            self._d.kube.on_refused(ResourceName(resource), count, message or reason, fit)


class Daemon:
    def __init__(self, options: RunOptions, platform: Platform | None = None) -> None:
        self.options = options
        self.platform = platform or Platform()
        self.board = HealthBoard()
        self.registry = CollectorRegistry()
        self.metrics = PluginMetrics(self.registry)
        self._stop = asyncio.Event()
        self._reload = asyncio.Event()
        self._config_digest = ""
        self._started_parts: list[Any] = []
        self._serving = False
        self._holders: dict[tuple[str, ...], tuple[str, str, str]] = {}
        self._mps_restarts_seen: dict[GpuUuid, int] = {}
        self._serving_state: tuple[str | None] | None = None  # (why none) last announced
        self._dra_failed = False  # the DRA front-end could not start (logged, state file)

    # ---- state read by the parts -------------------------------------------------------
    @property
    def plan(self) -> SlicePlan:
        return self._plan

    def config(self) -> Config:
        return self._config

    # ---- startup -----------------------------------------------------------------------
    def _load_config(self) -> Config:
        config = load_config(self.options.config_path)
        if self.platform.control_binary:  # simulation: its fake binary, started directly
            config = with_control_binary(config, self.platform.control_binary)
        if self.platform.spec_dirs and config.cdi.spec_dirs == CdiConfig().spec_dirs:
            config = with_spec_dirs(config, self.platform.spec_dirs)
        return config

    def _prepare(self) -> None:
        opts = self.options
        config = self._load_config()
        self._config = config
        self._config_digest = self._digest()
        for directory, mode in ((opts.state_dir, 0o700), (opts.cdi_dir, 0o755)):
            fsutil.ensure_dir(directory, mode)
        fsutil.ensure_dir(opts.mps_root, 0o755)
        if self.platform.set_up is not None:
            self.platform.set_up(config)
        self.session = NvmlSession.open()
        self.inventory = read_inventory(
            self.session,
            self.platform.sysfs_root or opts.sysfs_root,
            config.cdi.nvidia_ctk_path,
            self.platform.node_facts,
            opts.host_root,
        )
        self.inventory = with_remembered(self.inventory, opts.state_dir)
        self._shm: dict[GpuUuid, ShmState] = {}
        self._plan = self._node_plan(config)
        log_plan(self._plan)
        self.ledger = Ledger(opts.state_dir)
        self.mps = MpsSupervisor(
            opts.mps_root,
            self.config,
            self.board,
            self.session if config.mps.set_compute_mode else None,
            shm_states=lambda: self._shm,
        )
        self.feed = DeviceFeed(lambda: self._plan, self.board, self.ledger.used_ids)
        # pod-resources runs with or without a cluster: allocations end when it stops listing them
        self.poller = PodResourcesPoller(
            PodResourcesClient(str(opts.pod_resources_socket)),
            self.ledger,
            resources=None,
            reconcile=self._reconcile,
        )
        self.kube = self._kube()
        self.dra = self._dra_frontend(self._plan)
        self.allocator = Allocator(
            lambda: self._plan,
            self.config,
            opts.cdi_dir,
            opts.mps_root,
            self.ledger,
            self.board,
            mps=self.mps,
            ceilings=self.kube,
        )
        self.metrics.attach_slices(self._slice_counts)
        self.metrics.attach_allocations(self._allocation_memory)
        self.metrics.attach_dra(lambda: self.dra.counts() if self.dra is not None else None)
        self.poller.add_listener(self._remember_holders)
        self.health = self._health_monitor()
        # parsed here, so a bad --metrics-address fails before anything has started
        self.metrics_server = MetricsServer(opts.metrics_address, self.registry, self.ready)

    # ---- before the first Register: answers the kubelet may replay ------------------------
    def restore_answers(self) -> None:
        """Make every answer the ledger still holds valid again, before the first Register.

        After a reboot the kubelet replays checkpointed Allocate answers without calling
        Allocate (DESIGN 3b), and /var/run/cdi is a tmpfs: what those answers name must exist
        before a container can start. Blocking; runs off the event loop.
        """
        self._restore_cdi_specs()
        self._restore_mps()

    def _restore_cdi_specs(self) -> None:
        """Rewrite the CDI spec of every allocation in the ledger (the ledger keeps each
        spec's body; the CDI dir may be a fresh tmpfs)."""
        restored, lost = restore_cdi_specs(self.ledger, self.options.cdi_dir)
        if restored or lost:
            logs.log(LOG, "cdi specs restored", count=restored, without_body=lost)

    def _restore_mps(self, timeout: float = 60.0) -> None:
        """Recreate each sm-sharing GPU's pipe and shm directories and have the daemons of
        the GPUs that hold records serving.

        The dirs (and the shm tmpfs) were made when the plan was checked; the supervisor
        started its workers. Here: wait for the daemon of every sm-sharing GPU a record
        names, since a replayed container calls no Allocate that would start it.
        """
        in_use = self.ledger.gpus_in_use()
        deadline = time.monotonic() + timeout  # one wait for all: the daemons start in parallel
        for gp in self._plan.gpus:
            if gp.mode is not Mode.SM_SHARING or not gp.advertised or gp.uuid not in in_use:
                continue
            ready = self.mps.wait_ready(gp.uuid, max(0.0, deadline - time.monotonic()))
            logs.log(
                LOG,
                "mps daemon restored" if ready else "mps daemon not ready before register",
                level=logging.INFO if ready else logging.WARNING,
                gpu=gp.uuid,
            )

    def _node_plan(self, config: Config) -> SlicePlan:
        """The plan less what this node cannot serve: GPUs whose driver CDI device does not
        resolve, sm-sharing GPUs without their shm dir."""
        plan = checked_plan(self.inventory, config)
        dirs = [Path(d) for d in config.cdi.spec_dirs]
        self._driver_devices = driver_devices(dirs, config.cdi.driver_kind)
        missing = missing_driver_devices(plan, config, self._driver_devices)
        for gpu, why in missing.items():
            logs.log(LOG, "gpu not advertised", level=logging.WARNING, gpu=gpu, reason=why)
        return self._with_mps_shm(skip_gpus(plan, missing), config)

    def _watch_driver_cdi(self, loop: asyncio.AbstractEventLoop) -> DriverDeviceWatch:
        """Re-plan (as a reload does) when the driver's CDI devices change."""
        config = self._config
        self._watched_cdi = (config.cdi.spec_dirs, config.cdi.driver_kind)

        def changed(_devices: frozenset[str]) -> None:
            loop.call_soon_threadsafe(self._reload.set)

        watch = DriverDeviceWatch(
            [Path(d) for d in config.cdi.spec_dirs],
            config.cdi.driver_kind,
            self._driver_devices,
            changed,
        )
        watch.start()
        return watch

    def _with_mps_shm(self, plan: SlicePlan, config: Config) -> SlicePlan:
        """Make each sm-sharing GPU's pipe and shm dirs (mounting the shm tmpfs); a GPU whose
        shm cannot be mounted on a node is not advertised (`mps-shm-unavailable`)."""
        skipped: dict[GpuUuid, str] = {}
        for gp in plan.gpus:
            if gp.mode is not Mode.SM_SHARING or not gp.advertised:
                continue
            try:
                state, why = shm.ensure(
                    self.options.mps_root,
                    gp.uuid,
                    config.mps.shm_size,
                    simulated=self.platform.simulated,
                )
            except (LayoutError, OSError) as exc:
                state, why = ShmState.UNAVAILABLE, str(exc)
            if self._shm.get(gp.uuid) is not state:
                warn = state in (ShmState.HOST, ShmState.UNAVAILABLE)
                logs.log(LOG, "mps shm", level=logging.WARNING if warn else logging.INFO,
                         gpu=gp.uuid, state=state.value, detail=why)  # fmt: skip
            self._shm[gp.uuid] = state
            if state is ShmState.UNAVAILABLE:
                skipped[gp.uuid] = shm.SKIP_REASON
        return skip_gpus(plan, skipped)

    def _kube(self) -> Any:
        from deviceplugin.kube.integration import kube_from_environment

        return kube_from_environment(
            self.options.node_name,
            str(self.options.pod_resources_socket),
            self.ledger,
            environ=self.options.environ,
            poller=self.poller,
        )

    def _dra_frontend(self, plan: SlicePlan) -> Any:
        """The DRA front-end when the plan has DRA GPUs and the API server is reachable."""
        if not plan.dra_gpus:
            return None
        from deviceplugin.dra.frontend import DraFrontend, not_served, unavailable_reason

        opts = self.options
        if self.kube is None:
            reason = unavailable_reason(opts.node_name, opts.environ)
            not_served(opts.state_dir, plan, reason or "bad API credentials (see the kube log)")
            return None
        return DraFrontend(
            api=self.kube.api,
            node_name=self.kube.node_name,
            config=self.config,
            plan=lambda: self._plan,
            mps=self.mps,
            cdi_dir=opts.cdi_dir,
            mps_root=opts.mps_root,
            state_dir=opts.state_dir,
            plugins_dir=opts.kubelet_plugins_dir,
            registry_dir=opts.kubelet_registry_dir,
            driver_version=self.inventory.node.driver_version,
            node_event=self.kube.node_event,
            board=self.board,
            metrics=self.metrics,
        )

    def _health_monitor(self) -> Any:
        from deviceplugin.health import HealthMonitor, supervisor_server_active

        return HealthMonitor(
            self.session,
            lambda: self._plan,
            self.config,
            self.board,
            self.options.state_dir,
            mps_server_active=supervisor_server_active(self.mps),
            on_transition=self._on_transition,
        )

    def _on_transition(self, transition: Any) -> None:
        self.metrics.health_transition(
            str(transition.domain), cause_class(str(transition.cause)), transition.healthy
        )
        if self.kube is not None:
            self.kube.on_health_transition(
                transition.gpu, transition.domain, transition.cause, transition.healthy
            )

    def _reconcile(self, live: Any) -> Any:
        removed = self.allocator.reconcile(live)
        if removed:
            self.feed.poke()
            self.publish()
        return removed

    def after_allocate(self) -> None:
        # No feed.poke(): an allocation changes what the kubelet sees only through the board
        # (a client limit reached), which pokes the feed itself.
        self.poller.wake()
        self.publish()

    def publish(self) -> None:
        """Tell the API server the plan, health and free slices (it rate-limits itself)."""
        if self.kube is not None and self._serving:
            self.kube.publish_plan(self._plan, self.board, self.ledger)

    def announce_serving(self) -> None:
        """Log, and tell the node through an Event, when the plan starts or stops serving
        nothing (a rollout must see why a ready plugin advertises no slice)."""
        why = serving_none_message(self._plan)
        if self._serving_state == (why,):
            return
        first = self._serving_state is None
        self._serving_state = (why,)
        if why is None and first:
            return  # serving from the start: nothing to say
        if why is not None:
            logs.log(LOG, "serving none", level=logging.WARNING, reason=why)
        else:
            logs.log(LOG, "serving again", resources=",".join(self._plan.resources))
        if self.kube is not None:
            self.kube.on_serving(why, self._plan.resources)

    def _slice_counts(self) -> list[SliceCount]:
        counts: dict[tuple[str, str, str, str], int] = {}
        for gp in self._plan.gpus:
            if not gp.device_plugin:
                continue
            used = self.ledger.used_ids(gp.resource)
            faults = self.board.faults(gp.uuid).keys()
            for device in gp.device_ids:
                allocated = device in used
                health = device_health(gp.mode, faults, allocated).value
                key = (gp.resource, gp.uuid, health, "allocated" if allocated else "free")
                counts[key] = counts.get(key, 0) + 1
        return [SliceCount(r, g, h, s, n) for (r, g, h, s), n in sorted(counts.items())]

    def _remember_holders(self, listed: list[ContainerDevices]) -> bool:
        self._holders = {
            tuple(sorted(c.device_ids)): (c.namespace, c.pod, c.container) for c in listed
        }
        return False  # nothing here needs the fast poll

    def _allocation_memory(self) -> list[AllocationMemory]:
        """Memory used per allocation where NVML can tell: on a GPU with one allocation, the
        GPU's processes are that allocation's (NVML names processes, not containers)."""
        records = self.ledger.records()
        per_gpu: dict[GpuUuid, int] = {}
        for record in records:
            per_gpu[record.gpu] = per_gpu.get(record.gpu, 0) + 1
        out: list[AllocationMemory] = []
        for record in records:
            used: int | None = None
            if per_gpu[record.gpu] == 1:
                try:
                    procs = self.session.running_processes(record.gpu)
                    used = sum(p.used_memory or 0 for p in procs)
                except Exception:  # a lost GPU or an old driver: unknown, not zero
                    used = None
            ns, pod, container = self._holders.get(record.key, ("", "", ""))
            limit = (record.limit_mib or 0) * MIB
            out.append(
                AllocationMemory(record.resource, record.gpu, ns, pod, container, used, limit)
            )
        return out

    def ready(self) -> bool:
        """Health runs and every planned front-end is registered with the kubelet.

        A plan that serves nothing is ready once its (empty) registration pass is done, so a
        rollout never stalls on a node that has nothing to offer.
        """
        served = [self._plugins.all_registered()]
        if self.dra is not None:
            served.append(self.dra.ready())
        if self._dra_failed:  # planned and reachable, but its checkpoint is unusable
            served.append(False)
        return all(served) and self.health.running

    # ---- running -----------------------------------------------------------------------
    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT; raises ConfigError (exit 2) or StartupError (exit 1)."""
        loop = asyncio.get_running_loop()
        sys.setswitchinterval(SWITCH_INTERVAL)
        self._prepare()
        self._plugins = PluginSet(
            self.options.kubelet_dir,
            f"{os.getpid()}{os.urandom(2).hex()}",
            lambda resource: DevicePluginService(
                resource, self.feed, AllocationService(self), DaemonObserver(self)
            ),
            on_registered=self.metrics.registered,
            on_kubelet_restart=self.metrics.kubelet_restart,
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload.set)
        watcher = self._watch_config(loop)
        self._cdi_watch = self._watch_driver_cdi(loop)
        try:
            await asyncio.to_thread(self.mps.sync, self._plan)
            self._start(self.mps, self.health, self.poller)
            await asyncio.to_thread(self.restore_answers)
            if self.kube is not None:
                self._start(self.kube)
            self._serving = True
            self.board.subscribe(self.publish)
            self.publish()
            self.announce_serving()
            self._start(*self.platform.extras)
            self._start(self.metrics_server)
            await self._plugins.start(list(self._plan.resources))
            await self._start_dra()
            logs.log(LOG, "running", resources=",".join(self._plan.resources),
                     dra_gpus=len(self._plan.dra_gpus) if self.dra is not None else 0)  # fmt: skip
            mps_metrics = asyncio.create_task(self._follow_mps(), name="mps-metrics")
            freeze_heap()
            try:
                await self._serve()
            finally:
                mps_metrics.cancel()
        finally:
            if watcher is not None:
                watcher.stop()
            self._cdi_watch.stop()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            await self._shutdown()
        return 0

    async def _follow_mps(self, every: float = 2.0) -> None:
        """MPS restarts and probe latency into metrics, from the supervisor's snapshots."""
        while True:
            for gpu, snap in self.mps.snapshot().items():
                seen = self._mps_restarts_seen.get(gpu, 0)
                for _ in range(max(0, snap.restarts - seen)):
                    self.metrics.mps_restart(gpu)
                self._mps_restarts_seen[gpu] = snap.restarts
                if snap.last_probe_latency is not None:
                    self.metrics.mps_probe_latency(gpu, snap.last_probe_latency)
            await asyncio.sleep(every)

    def _start(self, *parts: Any) -> None:
        for part in parts:
            part.start()
            self._started_parts.append(part)

    async def _serve(self) -> None:
        while not self._stop.is_set():
            stop = asyncio.create_task(self._stop.wait())
            reload = asyncio.create_task(self._reload.wait())
            await asyncio.wait({stop, reload}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            reload.cancel()
            if self._reload.is_set() and not self._stop.is_set():
                self._reload.clear()
                await self.reload()

    async def _shutdown(self) -> None:
        started = time.monotonic()
        await self._plugins.stop()
        if self.dra is not None:
            await self.dra.stop()
        for part in reversed(self._started_parts):
            try:
                await asyncio.wait_for(asyncio.to_thread(part.stop), STOP_TIMEOUT / 2)
            except Exception as exc:  # stopping must go on whatever one part does
                logs.log(LOG, "stop failed", level=logging.WARNING, part=type(part).__name__,
                         error=repr(exc))  # fmt: skip
        self._started_parts.clear()
        await asyncio.to_thread(self.ledger.wait_durable, STOP_TIMEOUT / 2)
        self.session.shutdown()
        logs.log(LOG, "stopped", seconds=round(time.monotonic() - started, 3))

    # ---- reload ------------------------------------------------------------------------
    def _digest(self) -> str:
        path = self.options.config_path
        if path is None:
            return ""
        try:
            return hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            return "unreadable"

    async def reload(self) -> bool:
        """Re-read the config; a bad one keeps the running config (and says why)."""
        self._config_digest = self._digest()
        try:
            config = self._load_config()
            new_plan = self._node_plan(config)
        except ConfigError as exc:
            for problem in exc.problems:
                logs.log(LOG, "reload rejected", level=logging.WARNING, problem=problem)
            return False
        in_use = set(self.ledger.gpus_in_use())
        if self.dra is not None:
            in_use |= self.dra.gpus_in_use()
        merged, held = merge_reload(self._plan, new_plan, in_use)
        for gpu in held:
            logs.log(LOG, "reload held back", gpu=gpu, reason="GPU has allocated slices")
        self._config = config
        self._plan = merged
        log_plan(merged)
        if (config.cdi.spec_dirs, config.cdi.driver_kind) != self._watched_cdi:
            self._cdi_watch.stop()  # the config names other spec dirs or another kind
            self._cdi_watch = self._watch_driver_cdi(asyncio.get_running_loop())
        await asyncio.to_thread(self.mps.sync, merged)
        self.allocator.refresh_client_limits()
        self.feed.poke()
        await self._plugins.sync(list(merged.resources))
        await self._reload_dra(merged)
        self.publish()
        self.announce_serving()
        freeze_heap()  # the old plan's objects were frozen too: let them go
        logs.log(LOG, "reloaded", resources=",".join(merged.resources), held_back=len(held))
        return True

    async def _reload_dra(self, plan: SlicePlan) -> None:
        """Republish for the new plan; the first DRA GPU of a reload starts the front-end."""
        if self.dra is not None:
            self.dra.plan_changed()
            return
        self.dra = self._dra_frontend(plan)
        await self._start_dra()

    async def _start_dra(self) -> None:
        if self.dra is not None and not await self.dra.start():
            self.dra = None
            self._dra_failed = True

    def _watch_config(self, loop: asyncio.AbstractEventLoop) -> Any:
        """Watch the config's directory: a ConfigMap update swaps a `..data` symlink there."""
        path = self.options.config_path
        if path is None:
            return None
        daemon, config_name = self, path.name

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                # Only the file itself or a ConfigMap's `..data` link.
                names = {_name(event.src_path), _name(getattr(event, "dest_path", "") or "")}
                if config_name not in names and not any(n.startswith("..") for n in names):
                    return
                if daemon._digest() != daemon._config_digest:
                    loop.call_soon_threadsafe(daemon._reload.set)

        observer = Observer()
        observer.schedule(Handler(), str(path.parent), event_filter=list(CONFIG_EVENTS))
        observer.daemon = True
        observer.start()
        return observer
