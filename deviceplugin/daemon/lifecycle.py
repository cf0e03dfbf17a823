"""The node agent's lifecycle: wires the parts, runs them, reloads, and stops them in order.

`Daemon.run()` loads config and inventory, builds the plan, starts the MPS supervisor, the
health monitor, the Kubernetes integration, metrics and one gRPC server per resource, then
waits for SIGTERM/SIGINT (clean stop) or SIGHUP / a config file change (reload). What it
starts from and the steps before serving are `startup`'s, what it hands its servers
`backends`'s, and the config file's watch `config.watch`'s. Over
400 lines on purpose: the order in which the parts start and stop reads top to bottom in one
class.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from deviceplugin.cdi import generated
from deviceplugin.cdi.generated import DriverSpecGenerator
from deviceplugin.cdi.registry import DriverDeviceWatch
from deviceplugin.config.settings import (
    CdiConfig,
    Config,
    ConfigError,
    with_control_binary,
    with_spec_dirs,
)
from deviceplugin.config.watch import config_digest, watch_config
from deviceplugin.daemon.backends import AllocationService, DaemonObserver, MetricsFeed, cause_class
from deviceplugin.daemon.startup import (
    Platform,
    RunOptions,
    freeze_heap,
    load_config,
    log_plan,
    node_plan,
    restore_answers,
)
from deviceplugin.dpapi.allocator import Allocator
from deviceplugin.dpapi.feed import DeviceFeed
from deviceplugin.dpapi.podresources import PodResourcesClient, PodResourcesPoller
from deviceplugin.dpapi.registry import PluginSet
from deviceplugin.dpapi.server import DevicePluginService
from deviceplugin.health.board import HealthBoard
from deviceplugin.inventory.cache import with_remembered
from deviceplugin.inventory.gpus import InventoryError, read_driver_version, read_inventory
from deviceplugin.inventory.nvml import NvmlSession
from deviceplugin.ledger.store import Ledger
from deviceplugin.metrics.families import PluginMetrics
from deviceplugin.metrics.server import MetricsServer
from deviceplugin.model import GpuUuid
from deviceplugin.mps.shm import ShmState
from deviceplugin.mps.supervisor import MpsSupervisor
from deviceplugin.plan import SlicePlan, merge_reload, serving_none_message
from deviceplugin.plumbing import fsutil, logs

LOG = logs.get("daemon")
STOP_TIMEOUT = 4.0
# The event loop answers the kubelet; the other threads (health, MPS, status writer, API
# watches) run Python in bursts. A thread wanting the GIL waits up to this long before the
# holder is asked to drop it (Python's default: 5 ms, a whole Allocate budget many times over).
SWITCH_INTERVAL = 0.001


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
        self._config_digest = config_digest(opts.config_path)
        # Our own umask, not whatever the runtime passed on (0 in some): nothing we or the
        # MPS daemons we start create is group- or world-writable by accident. Files others
        # must read (CDI specs, the pipe dir) get their modes explicitly anyway.
        os.umask(0o022)
        for directory, mode in ((opts.state_dir, 0o700), (opts.cdi_dir, 0o755)):
            fsutil.ensure_dir(directory, mode)
        # The state dir may predate us at another mode (a hostPath DirectoryOrCreate is 0755).
        fsutil.restrict_dir(opts.state_dir, 0o700)
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
        self._generator = self._driver_spec_generator()
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
        self.metrics_feed = MetricsFeed(
            lambda: self._plan, self.ledger, self.board, self.session, self.mps, self.metrics
        )
        self.metrics.attach_slices(self.metrics_feed.slice_counts)
        self.metrics.attach_allocations(
            self.metrics_feed.allocation_memory, lambda: self.config().metrics.pod_labels
        )
        self.metrics.attach_dra(lambda: self.dra.counts() if self.dra is not None else None)
        self.poller.add_listener(self.metrics_feed.remember_holders)
        self.health = self._health_monitor()
        # parsed here, so a bad --metrics-address fails before anything has started
        self.metrics_server = MetricsServer(opts.metrics_address, self.registry, self.ready)

    # ---- before the first Register: answers the kubelet may replay ------------------------
    def restore_answers(self) -> None:
        """Make every answer the ledger still holds valid again, before the first Register
        (startup.restore_answers). Blocking; runs off the event loop."""
        restore_answers(self.ledger, self._plan, self.options.cdi_dir, self.mps.wait_ready)

    def _driver_spec_generator(self) -> DriverSpecGenerator:
        """Generates our driver spec where the toolkit's lacks a GPU (GPU Operator nodes):
        the host's nvidia-ctk, in the host's mount namespace when the plugin runs in a
        container (`--host-root`); the simulated node's stand-in under `--simulate`."""
        in_container = self.options.host_root != Path("/") and not self.platform.simulated
        return DriverSpecGenerator(
            self.options.cdi_dir,
            prefix=generated.HOST_PREFIX if in_container else (),
            binary=self.platform.nvidia_ctk,
        )

    def _node_plan(self, config: Config) -> SlicePlan:
        """The plan less what this node cannot serve (startup.node_plan); the driver's
        CDI devices it found are what their watch starts from. A driver version NVML
        reports differently from the inventory's (an upgrade) generates our spec again."""
        mps_root, simulated = self.options.mps_root, self.platform.simulated
        self._follow_driver_version()
        plan, self._driver_devices = node_plan(
            self.inventory,
            config,
            mps_root,
            self._shm,
            simulated=simulated,
            generator=self._generator,
        )
        return plan

    def _follow_driver_version(self) -> None:
        try:
            version = read_driver_version()
        except InventoryError:
            return  # keep what the inventory says; health reports a failing NVML
        node = self.inventory.node
        if version != node.driver_version:
            logs.log(LOG, "driver version changed", was=node.driver_version, now=version)
            node = dataclasses.replace(node, driver_version=version)
            self.inventory = dataclasses.replace(self.inventory, node=node)

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

    def _kube(self) -> Any:
        from deviceplugin.dpapi.kube_integration import kube_from_environment

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
            instance=opts.dra_instance,
            driver_version=self.inventory.node.driver_version,
            node_event=self.kube.node_event,
            board=self.board,
            metrics=self.metrics,
        )

    def _health_monitor(self) -> Any:
        from deviceplugin.health.monitor import HealthMonitor
        from deviceplugin.mps.supervisor import supervisor_server_active

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

    def _backends(self) -> tuple[AllocationService, DaemonObserver]:
        """A resource server's backend and observer (backends.py)."""
        service = AllocationService(
            lambda: self._plan, self.allocator, self.mps, self.after_allocate
        )
        observer = DaemonObserver(
            self.metrics, self.kube, lambda: self._plan, self.ledger, self.board
        )
        return service, observer

    # ---- running -----------------------------------------------------------------------
    def _kubelet_restarted(self) -> None:
        self.metrics.kubelet_restart()
        if self._plan.resources:
            self.ledger.pause_removals()  # its lists show no pod until it has restored them

    def _registered(self, resource: str) -> None:
        self.metrics.registered(resource)
        if self._plugins is not None and self._plugins.all_registered():
            self.ledger.hold_removals()  # the grace starts now: the kubelet restores its pods

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT; raises ConfigError (exit 2) or StartupError (exit 1)."""
        loop = asyncio.get_running_loop()
        sys.setswitchinterval(SWITCH_INTERVAL)
        self._prepare()
        self._plugins = PluginSet(
            self.options.kubelet_dir,
            f"{os.getpid()}{os.urandom(2).hex()}",
            lambda resource: DevicePluginService(resource, self.feed, *self._backends()),
            on_registered=self._registered,
            on_kubelet_restart=self._kubelet_restarted,
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload.set)
        watcher = watch_config(
            self.options.config_path, loop, lambda: self._config_digest, self._reload.set
        )
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
            if self._plan.resources:
                self.ledger.pause_removals()  # until registered: the kubelet may be starting
            await self._plugins.start(list(self._plan.resources))
            await self._start_dra()
            logs.log(LOG, "running", resources=",".join(self._plan.resources),
                     dra_gpus=len(self._plan.dra_gpus) if self.dra is not None else 0)  # fmt: skip
            mps_metrics = asyncio.create_task(self.metrics_feed.follow_mps(), name="mps-metrics")
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
        self.feed.close()
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
    async def reload(self) -> bool:
        """Re-read the config; a bad one keeps the running config (and says why)."""
        self._config_digest = config_digest(self.options.config_path)
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
