"""KubeIntegration: the plugin's optional link to the API server, run in background threads.

It answers ceilings from the pod cache (never the network), writes allocation records once
pod-resources shows which container got which devices, keeps the node's labels and plan
annotation current (rate-limited), and sends Events. Every write goes through one queue and
is retried with backoff; a failure is one log line and never reaches the gRPC path.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from deviceplugin.dpapi import ceilings as ceil
from deviceplugin.dpapi import kube_records as rec
from deviceplugin.dpapi.allocator import CeilingDecision
from deviceplugin.dpapi.podresources import (
    ContainerDevices,
    LedgerView,
    PodResourcesClient,
    PodResourcesPoller,
)
from deviceplugin.health.board import HealthBoard
from deviceplugin.kube.client import SERVICE_ACCOUNT_DIR, Api, Backoff, KubeError, call_with_retry
from deviceplugin.kube.pods import PodCache
from deviceplugin.ledger.record import AllocationRecord, key_of
from deviceplugin.model import FaultDomain, GpuUuid, ResourceName
from deviceplugin.plan import SlicePlan
from deviceplugin.plumbing import logs

LOG = logs.get("kube")

PodKey = tuple[str, str]  # (namespace, name)
ERROR = "error"  # ceiling source when the lookup itself failed (logged)


@dataclass(frozen=True)
class Settings:
    node_min_interval: float = 10.0  # seconds between node patches
    queue_size: int = 1000  # pending writes; beyond it new ones are dropped (logged)
    backoff: Backoff = field(default_factory=Backoff)
    join_timeout: float = 5.0
    repair_after: float = 30.0  # seconds our own record write is trusted over the cache


class KubeIntegration:
    """Start with `start()`; `stop()` is idempotent. All public methods return at once."""

    def __init__(
        self,
        api: Api,
        node_name: str,
        ledger: LedgerView,
        poller: PodResourcesPoller | None,
        settings: Settings | None = None,
        own_poller: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._node = node_name
        self._ledger = ledger
        self._poller = poller
        self._own_poller = own_poller
        self._settings = settings or Settings()
        self._clock = clock
        self._stop = threading.Event()
        self._started = False
        self._stopped = False
        self.pods = PodCache(api, node_name)
        self._writes: queue.Queue[tuple[str, Callable[[], Any], Callable[[Any], None]]] = (
            queue.Queue(self._settings.queue_size)
        )
        self._lock = threading.Lock()
        # allocations value last written per pod, and when
        self._patched: dict[PodKey, tuple[str, float]] = {}
        self._in_flight: set[PodKey] = set()
        self._reported: set[tuple[str, str, str]] = set()  # (pod uid, container, value)
        self._node_uid: str | None = None
        self._node_inputs: tuple[SlicePlan, HealthBoard, LedgerView] | None = None
        self._node_applied: dict[str, Any] | None = None
        self._node_last = float("-inf")
        self._node_wake = threading.Event()
        self._threads: list[threading.Thread] = []
        if poller is not None:
            poller.add_listener(self._on_listed)

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self.pods.start()
        for target, name in ((self._write_loop, "kube-writer"), (self._node_loop, "kube-node")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        if self._poller is not None and self._own_poller:
            self._poller.start()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        self._node_wake.set()
        with contextlib.suppress(queue.Full):  # wakes the writer
            self._writes.put_nowait(("stop", lambda: None, lambda _: None))
        if self._poller is not None and self._own_poller:
            self._poller.stop(self._settings.join_timeout)
        self.pods.stop(self._settings.join_timeout)
        for thread in self._threads:
            thread.join(self._settings.join_timeout)

    # --- ceilings (allocator.CeilingSource) --------------------------------------------------
    def ceiling_for(self, resource: ResourceName, count: int, gpu: GpuUuid) -> CeilingDecision:
        """Reads only memory: the pod cache and the last pod-resources List."""
        if not self.pods.synced:
            return CeilingDecision(None, ceil.NO_CACHE)
        try:
            resolution = ceil.resolve(self._candidates(resource, count))
            for invalid in resolution.invalid:
                self._report_invalid(invalid)
        except Exception as err:  # never fail an Allocate over a ceiling
            logs.log(LOG, "ceiling lookup failed", level=logging.ERROR, error=repr(err))
            return CeilingDecision(None, ERROR)
        return CeilingDecision(resolution.limit, resolution.source)

    def _candidates(self, resource: str, count: int) -> tuple[ceil.Candidate, ...]:
        pods = [p for p in self.pods.pods() if ceil.waiting(p)]
        holding = set(self._poller.holding()) if self._poller is not None else set()
        for pod in pods:
            holding.update(
                (pod.namespace, pod.name, c) for c in rec.recorded_containers(pod.annotations)
            )
        return ceil.candidates(pods, resource, count, holding)

    def _report_invalid(self, invalid: ceil.Invalid) -> None:
        pod = invalid.candidate.pod
        seen = (pod.uid, invalid.candidate.container.name, invalid.value)
        with self._lock:
            if seen in self._reported:
                return
            self._reported.add(seen)
        message = (
            f"{invalid.candidate.ceiling_key}={invalid.value!r} is not a valid ceiling "
            f"({invalid.error}); the limit stays at the request"
        )
        self._pod_event(pod.namespace, pod.name, pod.uid, "InvalidGpuMemoryLimit", message)

    # --- events ------------------------------------------------------------------------------
    def on_health_transition(
        self, gpu: GpuUuid, domain: FaultDomain, cause: str, healthy: bool
    ) -> None:
        if healthy:
            reason, message = "GpuHealthy", f"GPU {gpu}: {domain.value} recovered ({cause})"
        else:
            reason, message = "GpuUnhealthy", f"GPU {gpu}: {domain.value} fault: {cause}"
        self.node_event(reason, message, warning=not healthy)

    def on_serving(self, none_reason: str | None, resources: Collection[str]) -> None:
        """The plan started serving nothing (`none_reason` says why), or serves again."""
        if none_reason is not None:
            reason, message, warning = rec.SERVING_NONE_REASON, none_reason, True
        else:
            reason, warning = rec.SERVING_AGAIN_REASON, False
            message = "serving " + ", ".join(sorted(resources))
        self.node_event(reason, message, warning)

    def node_event(self, reason: str, message: str, warning: bool) -> None:
        """An Event about this node, sent from the writer thread."""

        def send() -> Any:
            involved = {"kind": "Node", "name": self._node, "uid": self._node_uid_or_fetch()}
            body = rec.event_body(involved, reason, message, warning, self._node)
            return self._api.create_event("default", body)

        self._enqueue(f"node event {reason}", send)

    @property
    def api(self) -> Api:
        """The client, shared with the DRA front-end (one connection pool, one credential)."""
        return self._api

    @property
    def node_name(self) -> str:
        return self._node

    def on_refused(self, resource: ResourceName, count: int, reason: str, largest_fit: int) -> None:
        """An Allocate was refused: tell the pods that may have asked (we cannot know which)."""
        logs.log(LOG, "allocation refused", resource=resource, count=count, reason=reason,
                 largest_fit=largest_fit)  # fmt: skip
        if not self.pods.synced:
            return
        found = self._candidates(resource, count)
        pods = {c.pod.uid: c.pod for c in found}
        for pod in pods.values():
            message = (
                f"allocation of {count} x {resource} refused: {reason}; the largest request "
                f"that fits on this node now is {largest_fit} x {resource}"
            )
            if len(pods) > 1:
                message += f" (one of {len(pods)} pods waiting for this request)"
            self._pod_event(pod.namespace, pod.name, pod.uid, "GpuAllocationRefused", message)

    def _pod_event(self, namespace: str, name: str, uid: str, reason: str, message: str) -> None:
        involved = {"kind": "Pod", "name": name, "namespace": namespace, "uid": uid}
        body = rec.event_body(involved, reason, message, True, self._node)
        self._enqueue(f"pod event {reason}", lambda: self._api.create_event(namespace, body))

    def _node_uid_or_fetch(self) -> str:
        if self._node_uid is None:
            try:
                node = self._api.get_node(self._node)
                self._node_uid = str((node.get("metadata") or {}).get("uid", ""))
            except KubeError:
                return ""  # the event still names the node
        return self._node_uid

    # --- node labels and plan annotation -----------------------------------------------------
    def publish_plan(self, plan: SlicePlan, board: HealthBoard, ledger: LedgerView) -> None:
        """Note what to publish and return: the caller may be Allocate or a health thread, so
        the patch is computed by the node thread, from the state current when it is sent."""
        with self._lock:
            self._node_inputs = (plan, board, ledger)
        self._node_wake.set()

    def _node_patch(self) -> dict[str, Any] | None:
        with self._lock:
            inputs = self._node_inputs
        if inputs is None:
            return None
        plan, board, ledger = inputs
        used = {d for r in ledger.records() for d in r.device_ids}
        return rec.node_patch(plan, board.snapshot(), used)

    def _node_loop(self) -> None:
        while not self._stop.is_set():
            self._node_wake.wait()
            self._node_wake.clear()
            if self._stop.is_set():
                return
            wait = self._node_last + self._settings.node_min_interval - self._clock()
            if wait > 0 and self._stop.wait(wait):
                return
            desired = self._node_patch()
            if desired is None or desired == self._node_applied:
                continue
            self._node_last = self._clock()
            done = call_with_retry(
                f"patch node {self._node}",
                lambda d=desired: self._api.patch_node(self._node, d),  # type: ignore[misc]
                self._stop,
                self._settings.backoff,
            )
            if done is not None:
                self._node_applied = desired
            else:
                self._node_wake.set()  # try again after the rate limit

    # --- allocation records ------------------------------------------------------------------
    def _on_listed(self, listed: list[ContainerDevices]) -> bool:
        """Poller listener: write missing allocation records; True while some are pending."""
        by_key = {r.key: r for r in self._ledger.records()}
        assigned: dict[PodKey, list[tuple[str, AllocationRecord]]] = {}
        for c in listed:
            record = by_key.get(key_of(c.device_ids))
            if record is not None:
                assigned.setdefault((c.namespace, c.pod), []).append((c.container, record))
        pending = False
        with self._lock:
            for gone in set(self._patched) - set(assigned):
                del self._patched[gone]
        for pod_key, items in assigned.items():
            value = rec.allocations_value(rec.by_container(items))
            if self._written(pod_key, value):
                continue
            pending = True
            self._patch_allocations(pod_key, value)
        return pending

    def _written(self, pod_key: PodKey, value: str) -> bool:
        """The pod carries `value`: per the cache, or per our own recent successful patch."""
        pod = self.pods.get(*pod_key) if self.pods.synced else None
        if pod is not None and pod.annotations.get(rec.ALLOCATIONS_KEY) == value:
            return True
        with self._lock:
            patched = self._patched.get(pod_key)
        if patched is None or patched[0] != value:
            return False
        # Trust our own write until the cache had time to show it; after that the cache
        # decides, so a record someone removed gets written again.
        return pod is None or self._clock() - patched[1] < self._settings.repair_after

    def _patch_allocations(self, pod_key: PodKey, value: str) -> None:
        with self._lock:
            if pod_key in self._in_flight:
                return
            self._in_flight.add(pod_key)
        namespace, name = pod_key
        body = {"metadata": {"annotations": {rec.ALLOCATIONS_KEY: value}}}

        def done(result: Any) -> None:
            with self._lock:
                self._in_flight.discard(pod_key)
                if result is not None:
                    self._patched[pod_key] = (value, self._clock())

        if not self._enqueue(
            f"record allocations on {namespace}/{name}",
            lambda: self._api.patch_pod(namespace, name, body),
            done,
        ):
            done(None)

    # --- the write queue ---------------------------------------------------------------------
    def _enqueue(
        self,
        what: str,
        call: Callable[[], Any],
        done: Callable[[Any], None] = lambda _: None,
    ) -> bool:
        if self._stopped:
            return False
        try:
            self._writes.put_nowait((what, call, done))
        except queue.Full:
            logs.log(LOG, "kubernetes write dropped: queue full", level=logging.WARNING, what=what)
            return False
        return True

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            try:
                what, call, done = self._writes.get(timeout=0.5)
            except queue.Empty:
                continue
            result = None
            try:
                result = call_with_retry(what, call, self._stop, self._settings.backoff)
            except Exception as err:  # a bug in one write must not end the writer
                logs.log(LOG, "kubernetes write error", level=logging.ERROR, what=what,
                         error=repr(err))  # fmt: skip
            done(result)

    def pending_writes(self) -> int:
        return self._writes.qsize()


def kube_from_environment(
    node_name: str | None,
    pod_resources_socket: str | None,
    ledger: LedgerView,
    *,
    environ: Mapping[str, str],
    resources: Collection[str] | None = None,
    service_account_dir: str = SERVICE_ACCOUNT_DIR,
    poller: PodResourcesPoller | None = None,
    settings: Settings | None = None,
) -> KubeIntegration | None:
    """The integration when credentials exist (service account, else KUBECONFIG), else None.

    Pass the daemon's own `poller` when it runs one (it should: the ledger needs
    pod-resources with or without a cluster); otherwise one is made from the socket and
    owned by the integration.
    """
    from deviceplugin.kube.client import load_api

    if not node_name:
        logs.log(LOG, "kubernetes integration off: no node name")
        return None
    try:
        api = load_api(environ, service_account_dir)
    except Exception as err:  # a broken kubeconfig must not stop the plugin
        logs.log(LOG, "kubernetes integration off: bad credentials", level=logging.WARNING,
                 error=str(err))  # fmt: skip
        return None
    if api is None:
        logs.log(LOG, "kubernetes integration off: no service account or KUBECONFIG")
        return None
    own = False
    if poller is None and pod_resources_socket:
        poller = PodResourcesPoller(PodResourcesClient(pod_resources_socket), ledger, resources)
        own = True
    return KubeIntegration(api, node_name, ledger, poller, settings, own_poller=own)
