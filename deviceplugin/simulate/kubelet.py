"""An embedded kubelet: the registration server and the device-manager client side.

Behaves like the real kubelet (reference/kubelet-device-manager.md) over real gRPC on unix
sockets: Register validates version, resource name and endpoint, dials the plugin (10 s) and
calls GetDevicePluginOptions before returning, then opens ListAndWatch in the background;
the newest registration for a resource wins; a restart deletes every socket in the directory
and listens on a fresh kubelet.sock. It is built on the synchronous grpc API and shares no
code with the plugin's server side, only the generated message modules.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb
from deviceplugin._pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc

SUPPORTED_VERSIONS = ("v1beta1",)
CHECKPOINT = "kubelet_internal_checkpoint"
DIAL_TIMEOUT = 10.0
_NAME_PART = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_extended_resource_name(name: str) -> bool:
    """The kubelet's v1helper.IsExtendedResourceName."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, short = ("requests." + name).rpartition("/")
    return (
        len(prefix) <= 253
        and bool(_DNS_SUBDOMAIN.fullmatch(prefix))
        and 0 < len(short) <= 63
        and bool(_NAME_PART.fullmatch(short))
    )


@dataclass
class Update:
    at: float  # time.monotonic() when received
    devices: list[tuple[str, str, tuple[int, ...]]]  # (ID, health, NUMA nodes)


@dataclass
class Endpoint:
    resource: str
    socket: Path
    options: Any
    channel: Any
    stub: Any
    registered_at: float
    updates: list[Update] = field(default_factory=list)
    stream: Any = None
    ended: str | None = None  # why ListAndWatch ended, if it did
    allocated: set[str] = field(default_factory=set)
    # Disconnected by the kubelet: kept (capacity stays for its grace period) with every
    # device unhealthy (`PluginDisconnected` → `markResourceUnhealthy`).
    disconnected: bool = False


class AdmissionError(Exception):
    """The kubelet refused a container before calling the plugin (UnexpectedAdmissionError)."""


class KubeletSimulator:
    """Start with `start()`; plugins register on `<dir>/kubelet.sock`."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._lock = threading.Condition()
        self._endpoints: dict[str, Endpoint] = {}
        self._connected: list[Endpoint] = []  # every client not yet closed, superseded or not
        self._server: grpc.Server | None = None
        self._pool = futures.ThreadPoolExecutor(max_workers=1)
        self.registrations: list[tuple[float, str, str]] = []  # (time, resource, endpoint)
        self.disconnects: list[tuple[float, str, str]] = []  # (time, resource, endpoint dropped)
        self.refuse_next = 0  # refuse this many Register calls (tests of the retry path)
        self.last_allocated: list[str] = []  # IDs of the last successful Allocate
        # Called with the resource name as each Register arrives, before it is accepted:
        # tests look at the node as the kubelet finds it then (e.g. after a reboot).
        self.before_register: Callable[[str], None] | None = None

    # ---- registration server -------------------------------------------------------
    @property
    def socket(self) -> Path:
        return self.dir / "kubelet.sock"

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.socket.exists():
            self.socket.unlink()
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kubelet")
        server = grpc.server(self._pool)
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop(0).wait()
            # like a real kubelet going away: handlers still dialing are abandoned
            self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            endpoints = list(self._connected)
            self._endpoints.clear()
            self._connected.clear()
        for ep in endpoints:
            self._close(ep)

    def restart(self) -> None:
        """What a kubelet restart does to the directory: every socket gone, a new kubelet.sock."""
        self.stop()
        for entry in self.dir.iterdir():
            if entry.is_socket() and entry.name != CHECKPOINT:
                entry.unlink()
        self.start()

    def _register(self, request: Any) -> str | None:
        """Returns an error message, or None when registered."""
        if self.before_register is not None:
            self.before_register(request.resource_name)
        with self._lock:
            if self.refuse_next > 0:
                self.refuse_next -= 1
                return "registration refused by test"
        if request.version not in SUPPORTED_VERSIONS:
            return (
                f"requested API version {request.version!r} is not supported by kubelet. "
                f"Supported version is {SUPPORTED_VERSIONS[0]!r}"
            )
        if not is_extended_resource_name(request.resource_name):
            return f"the ResourceName {request.resource_name!r} is invalid"
        socket = self.dir / request.endpoint
        channel = grpc.insecure_channel(
            f"unix://{socket}", options=[("grpc.default_authority", "localhost")]
        )
        try:
            grpc.channel_ready_future(channel).result(timeout=DIAL_TIMEOUT)
        except grpc.FutureTimeoutError:
            channel.close()
            return f"failed to dial device plugin: {socket}"
        stub = pb_grpc.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(pb.Empty())
        except grpc.RpcError as exc:
            channel.close()
            return f"failed to get device plugin options: {exc}"
        ep = Endpoint(request.resource_name, socket, options, channel, stub, time.monotonic())
        with self._lock:
            old = self._endpoints.get(request.resource_name)
            # The newest registration becomes the resource's client; the older one is not
            # disconnected (`connectClient` only replaces the map entry), its stream runs on.
            self._endpoints[request.resource_name] = ep
            self._connected.append(ep)
            self.registrations.append((ep.registered_at, request.resource_name, request.endpoint))
            if old is not None:
                ep.allocated = old.allocated
            self._lock.notify_all()
        threading.Thread(target=self._watch, args=(ep,), daemon=True, name="law").start()
        return None

    def _watch(self, ep: Endpoint) -> None:
        stream = ep.stub.ListAndWatch(pb.Empty())
        ep.stream = stream
        try:
            for response in stream:
                # Stamped on receipt (parsed, as the kubelet's Go decoder has it), before this
                # simulator's own Python copy of thousands of devices, which no kubelet makes.
                received = time.monotonic()
                devices = [
                    (d.ID, d.health, tuple(n.ID for n in d.topology.nodes))
                    for d in response.devices
                ]
                with self._lock:
                    ep.updates.append(Update(received, devices))
                    self._lock.notify_all()
            reason = "stream ended"
        except grpc.RpcError as exc:
            reason = f"{exc.code().name}"
        with self._lock:
            ep.ended = reason
            # Kubelet 1.36 `runClient` (pkg/kubelet/cm/devicemanager/plugin/v1beta1/
            # handler.go): when any client's stream ends, the client the resource name maps to
            # NOW is disconnected and every device of the resource marked unhealthy, even where
            # that is a newer plugin than the one that ended (1.37 keys clients by socket).
            current = self._endpoints.get(ep.resource)
            dropped = current if self._server is not None and current is not None else None
            if dropped is not None and dropped.disconnected:
                dropped = None  # already disconnected: its own stream's end changes nothing
            if ep in self._connected:
                self._connected.remove(ep)
            if dropped is not None:
                dropped.disconnected = True
                if dropped in self._connected:
                    self._connected.remove(dropped)
                self.disconnects.append((time.monotonic(), ep.resource, dropped.socket.name))
            self._lock.notify_all()
        if dropped is not None and dropped is not ep:
            self._close(dropped)

    @staticmethod
    def _close(ep: Endpoint) -> None:
        if ep.stream is not None:
            ep.stream.cancel()
        ep.channel.close()

    # ---- what tests and the demo read --------------------------------------------------
    def endpoint(self, resource: str) -> Endpoint | None:
        with self._lock:
            return self._endpoints.get(resource)

    def resources(self) -> list[str]:
        with self._lock:
            return sorted(r for r, ep in self._endpoints.items() if ep.updates)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.1))
        return True

    def devices(self, resource: str) -> list[tuple[str, str, tuple[int, ...]]]:
        ep = self.endpoint(resource)
        if not ep or not ep.updates:
            return []
        if ep.disconnected:
            return [(d, "Unhealthy", numa) for d, _, numa in ep.updates[-1].devices]
        return list(ep.updates[-1].devices)

    def healthy(self, resource: str) -> list[str]:
        return [d for d, health, _ in self.devices(resource) if health == "Healthy"]

    # ---- the device manager's allocation path --------------------------------------------
    def allocate(self, resource: str, count: int, must_include: Sequence[str] = ()) -> Any:
        """Like the kubelet admitting one container: preferred allocation, then Allocate."""
        ep = self.endpoint(resource)
        if ep is None:
            raise LookupError(f"no plugin registered for {resource}")
        available = [d for d in self.healthy(resource) if d not in ep.allocated]
        if len(available) + len(must_include) < count:
            # the device manager refuses admission itself; the plugin is never asked
            raise AdmissionError(
                f"requested number of devices unavailable for {resource}. "
                f"Requested: {count}, Available: {len(available)}"
            )
        ids = list(available[:count])
        if ep.options.get_preferred_allocation_available:
            req = pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available,
                        must_include_deviceIDs=list(must_include),
                        allocation_size=count,
                    )
                ]
            )
            resp = ep.stub.GetPreferredAllocation(req, timeout=30)
            ids = list(resp.container_responses[0].deviceIDs)
        return self.allocate_ids(resource, ids)

    def allocate_ids(self, resource: str, ids: Sequence[str]) -> Any:
        ep = self.endpoint(resource)
        if ep is None:
            raise LookupError(f"no plugin registered for {resource}")
        req = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))]
        )
        resp = ep.stub.Allocate(req, timeout=30)
        ep.allocated.update(ids)
        self.last_allocated = list(ids)
        return resp.container_responses[0]

    def release(self, resource: str, ids: Sequence[str]) -> None:
        ep = self.endpoint(resource)
        if ep is not None:
            ep.allocated.difference_update(ids)


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: KubeletSimulator) -> None:
        self._kubelet = kubelet

    def Register(self, request: Any, context: Any) -> Any:
        error = self._kubelet._register(request)
        if error is not None:
            context.abort(grpc.StatusCode.UNKNOWN, error)
        return pb.Empty()
