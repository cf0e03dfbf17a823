"""DraFrontend: the DRA side of the node agent, started and stopped by the daemon.

It wires the claim reader (ClaimSource), the Preparer, the kubelet plugin (DRA and
registration sockets) and the SlicePublisher over the shared plan, config, MPS supervisor and
CDI directory. Every registration triggers a republish (the kubelet wipes a driver's slices
when it goes away), and so does every change on the health board: an unhealthy device
carries a taint with its cause until its domain recovers; a domain not yet judged (an MPS
daemon's first bring-up) is never published tainted nor reported Unhealthy. Its state
(registration, slices, dropped fields) goes to a state file that `inventory --state-dir`
shows. Without API
credentials or a node name there is no front-end at all: `unavailable_reason` says why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from deviceplugin.config.settings import Config
from deviceplugin.dra import slices
from deviceplugin.dra.checkpoint import Checkpoint, CheckpointError, ClaimEntry
from deviceplugin.dra.claims import ClaimReader
from deviceplugin.dra.health_stream import DeviceState, HealthStreamService
from deviceplugin.dra.plugin import DraKubeletPlugin, instance_lock
from deviceplugin.dra.prepare import Preparer
from deviceplugin.dra.publisher import Settings, SlicePublisher, SliceStatus, Taints, is_taint_path
from deviceplugin.dra.status import ClaimStatusWriter
from deviceplugin.dra.taints import Cause, cause_class, device_cause, taint
from deviceplugin.health.board import HealthBoard
from deviceplugin.health.verdicts import DEFAULT_BOUND, Verdicts, unjudged
from deviceplugin.kube.client import SERVICE_ACCOUNT_DIR, Api, KubeError
from deviceplugin.metrics.families import DraCounts, PluginMetrics
from deviceplugin.model import FaultDomain, GpuUuid
from deviceplugin.mps.gate import MpsGate
from deviceplugin.plan import GpuPlan, SlicePlan
from deviceplugin.plumbing import fsutil, logs

LOG = logs.get("dra")
STATUS_FILE = "dra-status.json"


def unavailable_reason(
    node_name: str | None,
    environ: Mapping[str, str],
    service_account_dir: str = SERVICE_ACCOUNT_DIR,
) -> str | None:
    """Why DRA cannot be served on this node (None when it can): it needs the API server for
    ResourceSlices and claims, so credentials and the node's name."""
    if not node_name:
        return "no node name (--node-name or NODE_NAME)"
    token = os.path.join(service_account_dir, "token")
    in_cluster = bool(environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(token)
    kubeconfig = environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    if not in_cluster and not (kubeconfig and os.path.exists(kubeconfig)):
        return "no API credentials (service account or KUBECONFIG)"
    return None


def write_status(state_dir: Path, status: Mapping[str, Any]) -> None:
    data = json.dumps(status, sort_keys=True, indent=1).encode()
    fsutil.atomic_write(state_dir / STATUS_FILE, data, 0o644, durable=False)


def read_status(state_dir: Path) -> dict[str, Any] | None:
    """The running plugin's DRA state, or None when it wrote none."""
    try:
        data = json.loads((state_dir / STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def not_served(state_dir: Path, plan: SlicePlan, reason: str) -> None:
    """Log and record that the plan's DRA GPUs are not served, and why."""
    gpus = [gp.gpu.index for gp in plan.dra_gpus]
    logs.log(LOG, "DRA GPUs not served", level=logging.WARNING, gpus=",".join(map(str, gpus)),
             reason=reason)  # fmt: skip
    write_status(state_dir, {"served": False, "reason": reason, "gpus": gpus})


class DraFrontend:
    """`await start()` / `await stop()` (idempotent) from the daemon's event loop."""

    def __init__(
        self,
        *,
        api: Api,
        node_name: str,
        config: Callable[[], Config],
        plan: Callable[[], SlicePlan],
        mps: MpsGate | None,
        cdi_dir: Path,
        mps_root: Path,
        state_dir: Path,
        plugins_dir: Path,
        registry_dir: Path,
        driver_version: str,
        instance: str | None = None,
        node_event: Callable[[str, str, bool], None] | None = None,
        publisher_settings: Settings | None = None,
        driver: str = slices.DRIVER,
        board: HealthBoard | None = None,
        metrics: PluginMetrics | None = None,
        verdict_bound: float = DEFAULT_BOUND,
    ) -> None:
        self._node = node_name
        self._verdicts = Verdicts(self._health_changed, verdict_bound)
        self._plan = plan
        self._config = config
        self._board = board
        self._unsubscribe: Callable[[], None] | None = None
        self._state_dir = state_dir
        self._node_event = node_event
        self._lock = threading.Lock()
        self._registration: tuple[bool, str] | None = None
        self._error: str | None = None
        self.claims = ClaimReader(api)
        self._metrics = metrics
        self._abandoned_codes: set[int | None] = set()  # told in an Event once per status
        self.claim_status = ClaimStatusWriter(
            api, driver, node_name, mps_root, on_abandoned=self._on_status_abandoned
        )
        self.preparer = Preparer(
            driver=driver,
            node_name=node_name,
            config=config,
            plan=plan,
            claims=self.claims,
            mps=mps,
            cdi_dir=cdi_dir,
            mps_root=mps_root,
            checkpoint=Checkpoint.in_state_dir(state_dir),
            on_prepared=self.claim_status.submit,
            on_unprepared=self.claim_status.forget,
            # Rolling updates: the node's instances take turns over one checkpoint.
            instance_lock=instance_lock(plugins_dir, driver) if instance else None,
        )
        self.publisher = SlicePublisher(
            api,
            node_name,
            plan,
            driver_version,
            driver=driver,
            on_dropped=self._on_dropped,
            on_status=self._on_slices,
            settings=publisher_settings,
            taints=self._taints,
            on_republish=metrics.slice_republished if metrics is not None else None,
            max_clients=lambda: self._config().mps.max_clients,
            pending=self.pending,
            on_refused=self._on_refused,
        )
        self.health = HealthStreamService(node_name, self.device_states)
        self.plugin = DraKubeletPlugin(
            plugins_dir=plugins_dir,
            registry_dir=registry_dir,
            driver=driver,
            preparer=self.preparer,
            on_registration=self._on_registration,
            health=self.health,
            observer=metrics,
            instance=instance,
        )
        self._started = False

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> bool:
        """Serve; False (logged, recorded) when the checkpoint cannot be trusted."""
        try:
            await asyncio.to_thread(self.preparer.restore)
        except CheckpointError as err:
            # Never start empty over a broken checkpoint: prepared claims would be forgotten.
            self._error = f"checkpoint unusable: {err}"
            not_served(self._state_dir, self._plan(), self._error)
            return False
        self.claim_status.start()
        if self._board is not None:
            self._unsubscribe = self._board.subscribe(self._health_changed)
        self.publisher.start()
        await self.plugin.start()
        self._started = True
        self._write()
        logs.log(LOG, "DRA serving", driver=self.plugin.driver, node=self._node,
                 gpus=",".join(str(gp.gpu.index) for gp in self._plan().dra_gpus))  # fmt: skip
        return True

    async def stop(self) -> None:
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()
        self._verdicts.stop()
        await self.plugin.stop()
        if self._started:
            await asyncio.to_thread(self.publisher.stop)
            await asyncio.to_thread(self.claims.stop)
            await asyncio.to_thread(self.claim_status.stop)
        self._started = False

    # ---- health ------------------------------------------------------------------------
    def causes(self) -> list[tuple[GpuPlan, Cause | None]]:
        """Each DRA GPU (index order) and what makes its device unhealthy (None: healthy)."""
        gpus = sorted(self._plan().dra_gpus, key=lambda gp: gp.gpu.index)
        if self._board is None:
            return [(gp, None) for gp in gpus]
        return [(gp, device_cause(gp.mode, self._board.faults(gp.uuid))) for gp in gpus]

    def _waiting(self, gp: GpuPlan, cause: Cause | None) -> bool:
        """Not yet judged: the daemon's first bring-up runs (and its bound has not expired)."""
        starting = cause is not None and unjudged(cause.domain, cause.detail)
        return self._verdicts.waiting(slices.device_name(gp), starting)

    def pending(self) -> list[str]:
        """Devices whose domain is not yet judged: never published with a taint for it."""
        return [slices.device_name(gp) for gp, cause in self.causes() if self._waiting(gp, cause)]

    def _taints(self) -> Taints:
        effect = self._config().dra.unhealthy_taint_effect
        return {
            slices.device_name(gp): [taint(cause, effect)]
            for gp, cause in self.causes()
            if cause is not None
        }

    def device_states(self) -> list[DeviceState]:
        """What the health stream sends: Unknown while monitoring is down, else the taint's
        cause as the message of an Unhealthy device."""
        out = []
        for gp, cause in self.causes():
            name = slices.device_name(gp)
            if cause is None:
                out.append(DeviceState(name, "Healthy", ""))
            elif self._waiting(gp, cause):
                out.append(DeviceState(name, "Unknown", "awaiting the MPS daemon's first verdict"))
            else:
                health = "Unknown" if cause.domain is FaultDomain.MONITOR else "Unhealthy"
                out.append(DeviceState(name, health, f"{cause.value}: {cause.detail}"))
        return out

    def _health_changed(self) -> None:
        # Board listeners run under the monitor's lock: only wake-ups here.
        self.publisher.republish()
        self.health.poke()

    # ---- state -------------------------------------------------------------------------
    def ready(self) -> bool:
        return self._started and self.plugin.registered

    def plan_changed(self) -> None:
        self.publisher.plan_changed()

    def counts(self) -> DraCounts:
        """For the metrics: claims per mode of their devices, published taints per class."""
        prepared: dict[str, int] = {}
        for entry in self.preparer.prepared():
            for mode in {d.mode for d in entry.devices}:
                prepared[mode] = prepared.get(mode, 0) + 1
        taints: dict[str, int] = {}
        for _device, value in self.publisher.status.taints:
            taints[cause_class(value)] = taints.get(cause_class(value), 0) + 1
        return DraCounts(prepared, taints)

    def gpus_in_use(self) -> set[GpuUuid]:
        return self.preparer.gpus_in_use()

    def status(self) -> dict[str, Any]:
        with self._lock:
            registration = self._registration
        return {
            "served": self._started,
            "reason": self._error,
            "gpus": [gp.gpu.index for gp in self._plan().dra_gpus],
            "driver": self.plugin.driver,
            "registered": self.plugin.registered,
            "registrationError": registration[1] if registration and not registration[0] else None,
            "slices": self.publisher.status.as_dict(),
            "preparedClaims": len(self.preparer.prepared()),
            "claimStatus": {
                "written": self.claim_status.written,
                "pending": self.claim_status.pending(),
                "failures": self.claim_status.failures,
                "abandoned": self.claim_status.abandoned,
                "lastError": self.claim_status.last_error,
            },
        }

    def _write(self) -> None:
        try:
            write_status(self._state_dir, self.status())
        except OSError as err:  # the state file is a report; serving goes on
            logs.log(LOG, "dra status not written", level=logging.WARNING, error=str(err))

    # ---- callbacks (event loop, publisher thread) ---------------------------------------
    def _on_registration(self, ok: bool, error: str) -> None:
        with self._lock:
            self._registration = (ok, error)
        if ok:
            logs.log(LOG, "registered with the kubelet; republishing resourceslices")
            self.publisher.republish()
        else:
            logs.log(LOG, "kubelet registration failed", level=logging.WARNING,
                     error=error or "-")  # fmt: skip
        self._write()

    def _on_slices(self, status: SliceStatus) -> None:
        self._write()

    def _on_status_abandoned(self, entry: ClaimEntry, err: KubeError) -> None:
        if self._metrics is not None:
            self._metrics.claim_status_abandoned(err.status)
        with self._lock:
            first = err.status not in self._abandoned_codes
            self._abandoned_codes.add(err.status)
        if first and self._node_event is not None:
            self._node_event(
                "DraClaimStatusRefused",
                f"the API server refused the status of claim {entry.namespace}/{entry.name} "
                f"({err}); not retried. Claims refused the same way are counted in "
                "gpu_fraction_dra_claim_status_abandoned_total (is the node-scoped "
                "resourceclaims/driver permission granted?)",
                True,
            )

    def _on_refused(self, device: str, message: str) -> None:
        if self._node_event is not None:
            self._node_event(
                "DraDeviceRefused",
                f"the API server refused the ResourceSlice for {device}; it is not published, "
                f"the node's other GPUs are: {message}",
                True,
            )

    def _on_dropped(self, paths: list[str]) -> None:
        if self._node_event is None:
            return
        capacity = [p for p in paths if not is_taint_path(p)]
        lost_taints = [p for p in paths if is_taint_path(p)]
        parts = []
        if capacity:
            parts.append(
                "the API server dropped ResourceSlice fields (is DRAConsumableCapacity off?): "
                f"{', '.join(capacity[:4])}; fractional GPUs are published without "
                "consumable capacity (one claim per GPU)"
            )
        if lost_taints:
            parts.append(
                "the API server dropped device taints (is DRADeviceTaints off?): "
                f"{', '.join(lost_taints[:4])}; unhealthy devices stay schedulable (the health "
                "stream and claim status still report them)"
            )
        self._node_event("DraFieldsDropped", "; ".join(parts), True)
