"""Client of the kubelet's pod-resources API v1 (`List`) over its unix socket.

The device-plugin API has no de-allocate call; `List` is the kubelet's own view of which
container holds which devices, so the plugin rebuilds used slices and finds finished
allocations from it (reference/kubelet-device-manager.md section 9).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

import grpc

from deviceplugin._pb import podresources_v1_pb2 as pb
from deviceplugin._pb import podresources_v1_pb2_grpc as pb_grpc
from deviceplugin.ledger.record import AllocationRecord, Key, Listing, PodKey, key_of
from deviceplugin.model import ResourceName, SliceId
from deviceplugin.plumbing import logs

LOG = logs.get("podresources")


class PodResourcesError(Exception):
    """`List` failed: socket missing, kubelet down, or a timeout."""


@dataclass(frozen=True)
class ContainerDevices:
    """One container's devices of one resource, as the kubelet reports them."""

    namespace: str
    pod: str
    container: str
    resource: ResourceName
    device_ids: frozenset[SliceId]


Containers = list[ContainerDevices]


class PodResourcesClient:
    """Lazily connected `List` client; `close()` is idempotent."""

    def __init__(self, socket_path: str, timeout: float = 5.0) -> None:
        self._target = f"unix://{socket_path}"
        self._timeout = timeout
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.PodResourcesListerStub | None = None

    def list(self, resources: frozenset[str] | None = None) -> list[ContainerDevices]:
        """Every container's devices, optionally only those of `resources`."""
        return self.snapshot(resources)[0]

    def snapshot(
        self, resources: frozenset[str] | None = None
    ) -> tuple[Containers, frozenset[PodKey]]:
        """`list`, plus every pod the kubelet showed, with devices or without."""
        stub = self._connect()
        try:
            response = stub.List(pb.ListPodResourcesRequest(), timeout=self._timeout)
        except grpc.RpcError as err:
            # Drop the channel so a re-created kubelet socket gets a fresh connection.
            self.close()
            code = err.code() if isinstance(err, grpc.Call) else None
            raise PodResourcesError(f"pod-resources List failed: {code}") from err
        # The real kubelet lists each device of a container as an entry of its own (one per
        # NUMA node where a device reports several; pkg/kubelet/cm/container_manager_linux.go,
        # containerDevicesFromResourceDeviceInstances), never one entry per Allocate: the
        # container's devices of one resource are the union of its entries.
        grouped: dict[tuple[str, str, str, str], set[SliceId]] = {}
        pods = frozenset((pod.namespace, pod.name) for pod in response.pod_resources)
        for pod in response.pod_resources:
            for container in pod.containers:
                for dev in container.devices:
                    if resources is not None and dev.resource_name not in resources:
                        continue
                    key = (pod.namespace, pod.name, container.name, dev.resource_name)
                    grouped.setdefault(key, set()).update(SliceId(d) for d in dev.device_ids)
        out = [
            ContainerDevices(ns, pod_name, container, ResourceName(resource), frozenset(ids))
            for (ns, pod_name, container, resource), ids in grouped.items()
            if ids
        ]
        return out, pods

    def close(self) -> None:
        with self._lock:
            channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()

    def _connect(self) -> pb_grpc.PodResourcesListerStub:
        with self._lock:
            if self._stub is None:
                self._channel = grpc.insecure_channel(self._target)
                self._stub = pb_grpc.PodResourcesListerStub(self._channel)  # type: ignore[no-untyped-call]
            return self._stub


class LedgerView(Protocol):
    """What the poller needs of `ledger.Ledger`."""

    def records(self) -> list[AllocationRecord]: ...

    def reconcile(self, listing: Listing) -> list[AllocationRecord]: ...


Reconcile = Callable[[Listing], list[AllocationRecord]]
# Called after each successful List with what it listed; returns True while it still has
# work that needs the fast poll (e.g. an allocation record not yet written to its pod).
ListListener = Callable[[list[ContainerDevices]], bool]


class PodResourcesPoller:
    """Polls `List` in a thread: reconciles the ledger and tells listeners who holds what.

    Polls every `fast` seconds while an allocation is not yet listed (or a listener has work
    pending), else every `slow` seconds. A failed List never removes anything.
    """

    def __init__(
        self,
        client: PodResourcesClient,
        ledger: LedgerView,
        resources: Collection[str] | None = None,
        fast: float = 1.0,
        slow: float = 10.0,
        reconcile: Reconcile | None = None,
        min_gap: float = 0.2,
    ) -> None:
        self._client = client
        self._ledger = ledger
        # The allocator's reconcile also refreshes MPS client limits; default: the ledger's.
        self._reconcile = reconcile or ledger.reconcile
        self._resources = frozenset(resources) if resources is not None else None
        self.fast = fast
        self.slow = slow
        self.min_gap = min_gap
        self._listeners: list[ListListener] = []
        self._lock = threading.Lock()
        self._holding: frozenset[tuple[str, str, str]] = frozenset()
        self._listed = False
        self._failing = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.polls = 0

    def add_listener(self, listener: ListListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def holding(self) -> frozenset[tuple[str, str, str]]:
        """(namespace, pod, container) of every container the last List showed with devices."""
        return self._holding

    @property
    def listed(self) -> bool:
        """True once a List has succeeded."""
        return self._listed

    def wake(self) -> None:
        """Poll now (e.g. right after an Allocate)."""
        self._wake.set()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pod-resources", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                interval = self.poll_once()
            except Exception as err:  # a listener's bug must not end polling
                logs.log(LOG, "pod-resources poll error", level=logging.ERROR, error=repr(err))
                interval = self.slow
            self._wake.wait(interval)
            self._wake.clear()
            # Wakes after every Allocate coalesce: the kubelet rate-limits this API (100 QPS,
            # burst 10), and a burst of admissions needs one List, not one each.
            self._stop.wait(self.min_gap)

    def poll_once(self) -> float:
        """One List + reconcile + listeners; returns the seconds until the next poll."""
        self.polls += 1
        try:
            listed, pods = self._client.snapshot(self._resources)
        except PodResourcesError as err:
            if not self._failing:  # one line per outage, not per poll
                logs.log(LOG, "pod-resources unavailable", level=logging.WARNING, error=str(err))
            self._failing = True
            return self.fast if self._ledger.records() else self.slow
        if self._failing:
            logs.log(LOG, "pod-resources available again")
        self._failing = False
        held: dict[Key, PodKey | None] = {
            key_of(c.device_ids): (c.namespace, c.pod) for c in listed
        }
        self._reconcile(Listing(held, pods))
        self._holding = frozenset((c.namespace, c.pod, c.container) for c in listed)
        self._listed = True
        listed_keys = {tuple(sorted(c.device_ids)) for c in listed}
        # A record whose pod is known but no longer lists it (a finished init container)
        # needs no fast poll: only one waiting to be seen committed does.
        unlisted = any(r.key not in listed_keys and r.owner is None for r in self._ledger.records())
        with self._lock:
            listeners = list(self._listeners)
        busy = [listener(listed) for listener in listeners]
        return self.fast if unlisted or any(busy) else self.slow
