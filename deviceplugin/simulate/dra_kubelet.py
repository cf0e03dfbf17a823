"""An embedded kubelet for DRA: the plugin watcher and the DRA manager's client side.

Behaves like the real kubelet (reference/dra-kubelet-plugin.md §1): it watches its registry
directory for sockets, dials one (10 s), calls GetInfo (1 s), checks the type, the driver name
and `supported_versions` (walking the plugin's list in its order, taking the first service this
kubelet supports), dials the endpoint, and answers NotifyRegistrationStatus (5 s); a removed
socket deregisters the instance it registered. Like kubelets from 1.33
(`pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`, a list of instances per driver) it keeps
every registered instance of a driver, uses the newest one, falls back to the next newest when
that one's socket goes, and refuses a second registration of an endpoint already registered;
`instances` and `gaps` show what a rolling update did. Prepare and unprepare use the chosen
service with the 45 s call timeout and refuse an answer that lacks a requested claim.
`watch_health` opens the `v1alpha1.DRAResourceHealth` stream, as a kubelet with
`ResourceHealthStatus` on does for a plugin that lists it, and keeps what it sends.
`container_cdi_ids` picks a container's CDI IDs from the answers as the kubelet's claim info
does. Built on the synchronous grpc API, it
shares no code with the plugin's server side, only the generated message modules. Over 400
lines on purpose: the kubelet's side of three gRPC services and its claim bookkeeping.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import yaml

from deviceplugin._pb import dra_health_v1alpha1_pb2 as health_pb
from deviceplugin._pb import dra_health_v1alpha1_pb2_grpc as health_grpc
from deviceplugin._pb import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from deviceplugin._pb import pluginregistration_v1_pb2 as reg
from deviceplugin._pb import pluginregistration_v1_pb2_grpc as reg_grpc

# What kubelets since 1.34 support; a 1.32/1.33 kubelet knows only v1beta1.
SUPPORTED_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
SERVICES: dict[str, tuple[ModuleType, ModuleType]] = {
    "v1.DRAPlugin": (dra_v1_pb2, dra_v1_pb2_grpc),
    "v1beta1.DRAPlugin": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc),
}
HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
DIAL_TIMEOUT = 10.0
GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0
CALL_TIMEOUT = 45.0
POLL_INTERVAL = 0.05
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class KubeletError(Exception):
    """What the kubelet would report for the pod (plugin missing, RPC failed, claims skipped)."""


@dataclass
class Plugin:
    driver: str
    registration_socket: Path
    endpoint: Path
    service: str  # the chosen registration string, e.g. "v1.DRAPlugin"
    channel: Any
    registered_at: float
    versions: tuple[str, ...] = ()  # everything the plugin listed in supported_versions


@dataclass
class Refusal:
    socket: Path
    error: str
    at: float = field(default_factory=time.monotonic)


class DraKubeletSimulator:
    """Start with `start()`; plugins appear by creating a socket in `registry_dir`."""

    def __init__(self, registry_dir: Path, supported: Sequence[str] = SUPPORTED_SERVICES) -> None:
        self.registry_dir = registry_dir
        self.supported = tuple(supported)
        self._lock = threading.Condition()
        self._plugins: dict[str, list[Plugin]] = {}  # per driver, oldest first
        self._seen: dict[Path, tuple[int, int]] = {}  # socket → (dev, inode) handled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registrations: list[tuple[float, str, str]] = []  # (time, driver, service)
        self.refusals: list[Refusal] = []
        self.info: dict[str, Any] = {}  # driver → the last PluginInfo
        # (time, driver, registered instances) at every change: 0 after a registration is a gap
        self.instances: list[tuple[float, str, int]] = []

    # ---- the plugin watcher ----------------------------------------------------------------
    def start(self) -> None:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="dra-watcher")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            plugins = [p for group in self._plugins.values() for p in group]
            self._plugins.clear()
            self._seen.clear()
            self._lock.notify_all()
        for p in plugins:
            p.channel.close()

    def restart(self) -> None:
        """A kubelet restart as the plugin sees it: the registry directory is emptied and made
        again, every driver is forgotten until its socket shows up anew."""
        self.stop()
        shutil.rmtree(self.registry_dir, ignore_errors=True)
        self.registry_dir.mkdir(parents=True, exist_ok=True)  # a plugin may be quicker
        self.start()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_INTERVAL):
            current: dict[Path, tuple[int, int]] = {}
            try:
                entries = list(os.scandir(self.registry_dir))
            except FileNotFoundError:
                entries = []
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISSOCK(st.st_mode):
                    current[Path(entry.path)] = (st.st_dev, st.st_ino)
            for path in [p for p in self._seen if p not in current]:
                self._deregister(path)
            for path, identity in current.items():
                if self._seen.get(path) != identity:
                    if path in self._seen:  # replaced: a delete, then a create
                        self._deregister(path)
                    self._seen[path] = identity
                    self._register(path)

    def _register(self, socket: Path) -> None:
        channel = grpc.insecure_channel(
            f"unix://{socket}", options=[("grpc.default_authority", "localhost")]
        )
        try:
            grpc.channel_ready_future(channel).result(timeout=DIAL_TIMEOUT)
            info = reg_grpc.RegistrationStub(channel).GetInfo(
                reg.InfoRequest(), timeout=GET_INFO_TIMEOUT
            )
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            channel.close()
            self._refuse(socket, None, f"failed to get plugin info: {exc}")
            return
        error, service = self._validate(info)
        endpoint = Path(info.endpoint or str(socket))
        if error is None and any(p.endpoint == endpoint for p in self._group(info.name)):
            error = f"DRA plugin {info.name} with endpoint {endpoint} is already registered"
        plugin_channel = None
        if error is None:
            plugin_channel = grpc.insecure_channel(
                f"unix://{endpoint}", options=[("grpc.default_authority", "localhost")]
            )
            try:  # the kubelet's 1 s dial probe on first use
                grpc.channel_ready_future(plugin_channel).result(timeout=1.0)
            except grpc.FutureTimeoutError:
                plugin_channel.close()
                error = f"failed to connect to DRA plugin endpoint {endpoint}"
        stub = reg_grpc.RegistrationStub(channel)
        try:
            stub.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=error is None, error=error or ""),
                timeout=NOTIFY_TIMEOUT,
            )
        except grpc.RpcError:
            pass  # the kubelet only logs a failed notification
        finally:
            channel.close()
        if error is not None or plugin_channel is None:
            self._refuse(socket, info, error or "no channel")
            return
        plugin = Plugin(
            info.name, socket, endpoint, service, plugin_channel, time.monotonic(),
            tuple(info.supported_versions),
        )  # fmt: skip
        with self._lock:
            group = self._plugins.setdefault(info.name, [])
            group.append(plugin)
            self.info[info.name] = info
            self.registrations.append((plugin.registered_at, info.name, service))
            self.instances.append((time.monotonic(), info.name, len(group)))
            self._lock.notify_all()

    def _validate(self, info: Any) -> tuple[str | None, str]:
        if info.type != "DRAPlugin":
            return f"unsupported plugin type {info.type!r}", ""
        if not _DNS_SUBDOMAIN.fullmatch(info.name) or len(info.name) > 253:
            return f"invalid DRA driver name {info.name!r}", ""
        if not info.supported_versions:
            return "empty list of supported versions", ""
        for name in info.supported_versions:  # the plugin's order decides
            if name in self.supported:
                return None, name
        return (
            f"none of services supported by the plugin {list(info.supported_versions)} "
            f"are supported by the kubelet {list(self.supported)}"
        ), ""

    def _refuse(self, socket: Path, info: Any, error: str) -> None:
        with self._lock:
            self.refusals.append(Refusal(socket, error))
            if info is not None:
                self.info[info.name] = info
            self._lock.notify_all()

    def _deregister(self, socket: Path) -> None:
        self._seen.pop(socket, None)
        gone: list[Plugin] = []
        with self._lock:
            for driver, group in list(self._plugins.items()):
                mine = [p for p in group if p.registration_socket == socket]
                if not mine:
                    continue
                gone += mine
                group[:] = [p for p in group if p.registration_socket != socket]
                self.instances.append((time.monotonic(), driver, len(group)))
                if not group:
                    del self._plugins[driver]
            self._lock.notify_all()
        for p in gone:
            p.channel.close()

    def _group(self, driver: str) -> list[Plugin]:
        with self._lock:
            return list(self._plugins.get(driver, []))

    # ---- what tests and the demo read ----------------------------------------------------
    def plugin(self, driver: str) -> Plugin | None:
        """The instance the kubelet calls: the newest registered one."""
        with self._lock:
            group = self._plugins.get(driver)
            return group[-1] if group else None

    def gaps(self, driver: str) -> int:
        """How often the driver had no registered instance after having had one."""
        counts = [n for _, d, n in self.instances if d == driver]
        return sum(1 for n in counts[1:] if n == 0) if counts else 0

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.1))
        return True

    def wait_registered(self, driver: str, after: int = 0, timeout: float = 10.0) -> Plugin:
        """Wait until `driver` has registered more than `after` times in all; the plugin."""

        def done() -> bool:
            count = sum(1 for _, d, _ in self.registrations if d == driver)
            return count > after and driver in self._plugins

        if not self.wait_for(done, timeout):
            raise KubeletError(f"DRA driver {driver} did not register within {timeout} s")
        plugin = self.plugin(driver)
        assert plugin is not None
        return plugin

    # ---- the DRA manager's calls -----------------------------------------------------------
    def _stub(self, driver: str, service: str | None) -> tuple[ModuleType, Any]:
        plugin = self.plugin(driver)
        if plugin is None:
            raise KubeletError(f"DRA driver {driver} is not registered with this kubelet")
        pb, pb_grpc = SERVICES[service or plugin.service]
        return pb, pb_grpc.DRAPluginStub(plugin.channel)

    def prepare(
        self, driver: str, claims: Sequence[tuple[str, str, str]], service: str | None = None
    ) -> dict[str, Any]:
        """NodePrepareResources for (namespace, name, uid) claims; UID → the claim's answer."""
        pb, stub = self._stub(driver, service)
        request = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        response = stub.NodePrepareResources(request, timeout=CALL_TIMEOUT)
        return self._per_claim(response, claims, "prepare")

    def unprepare(
        self, driver: str, claims: Sequence[tuple[str, str, str]], service: str | None = None
    ) -> dict[str, Any]:
        pb, stub = self._stub(driver, service)
        request = pb.NodeUnprepareResourcesRequest(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        response = stub.NodeUnprepareResources(request, timeout=CALL_TIMEOUT)
        return self._per_claim(response, claims, "unprepare")

    def watch_health(self, driver: str) -> HealthWatch:
        """Open the driver's health stream (it must list the service); close() it after."""
        plugin = self.plugin(driver)
        if plugin is None:
            raise KubeletError(f"DRA driver {driver} is not registered with this kubelet")
        if HEALTH_SERVICE not in plugin.versions:
            raise KubeletError(f"DRA driver {driver} does not serve {HEALTH_SERVICE}")
        return HealthWatch(plugin.channel)

    @staticmethod
    def _per_claim(
        response: Any, claims: Sequence[tuple[str, str, str]], what: str
    ) -> dict[str, Any]:
        missing = [uid for _, _, uid in claims if uid not in response.claims]
        if missing:  # the kubelet fails the pod with "skipped N ResourceClaims" and retries
            raise KubeletError(f"{what}: skipped {len(missing)} ResourceClaims: {missing}")
        return {uid: response.claims[uid] for _, _, uid in claims}


@dataclass(frozen=True)
class DeviceHealth:
    health: str  # "HEALTHY" | "UNHEALTHY" | "UNKNOWN"
    message: str
    timeout_seconds: int
    last_updated: int


class HealthWatch:
    """One `NodeWatchResources` stream: every response kept; `devices()` is the last one, by
    (pool, device), as the kubelet's health cache holds it."""

    def __init__(self, channel: Any) -> None:
        stub = health_grpc.DRAResourceHealthStub(channel)
        self._call = stub.NodeWatchResources(health_pb.NodeWatchResourcesRequest())
        self._cond = threading.Condition()
        self.responses: list[dict[tuple[str, str], DeviceHealth]] = []
        self.received_at: list[float] = []
        self.error: str | None = None
        self._thread = threading.Thread(target=self._read, daemon=True, name="dra-health")
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                devices = {
                    (d.device.pool_name, d.device.device_name): DeviceHealth(
                        health_pb.HealthStatus.Name(d.health),
                        d.message,
                        d.health_check_timeout_seconds,
                        d.last_updated_time,
                    )
                    for d in response.devices
                }
                with self._cond:
                    self.responses.append(devices)
                    self.received_at.append(time.monotonic())
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            with self._cond:
                if exc.code() is not grpc.StatusCode.CANCELLED:
                    self.error = str(exc)
                self._cond.notify_all()

    def devices(self) -> dict[tuple[str, str], DeviceHealth]:
        with self._cond:
            return dict(self.responses[-1]) if self.responses else {}

    def wait_for(
        self, predicate: Callable[[dict[tuple[str, str], DeviceHealth]], bool], timeout: float
    ) -> dict[tuple[str, str], DeviceHealth]:
        """The first state (from now on, or the current one) that satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self.responses and predicate(self.responses[-1])):
                left = deadline - time.monotonic()
                if left <= 0 or self.error is not None:
                    raise KubeletError(f"health stream: not within {timeout} s ({self.error})")
                self._cond.wait(min(left, 0.1))
            return dict(self.responses[-1])

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5)


def container_cdi_ids(answers: Mapping[str, Any], claims: Sequence[tuple[str, str]]) -> list[str]:
    """The CDI device IDs the kubelet hands one container: for each of its
    `resources.claims[]` entries, (claim UID, request name or ""), the IDs of the claim's
    prepared devices whose `request_names` contain that name exactly, or every device when the
    entry names no request or the device names none (kubernetes `pkg/kubelet/cm/dra/
    claiminfo.go`, `ClaimInfo.cdiDevicesAsList`, over the devices `state.Device` keeps from
    the answer; called per entry by `manager.go` `GetResources`). A `request/subrequest`
    name matches no container: pods name requests."""
    ids: list[str] = []
    for uid, request in claims:
        for device in answers[uid].devices:
            names = list(device.request_names)
            if request == "" or not names or request in names:
                ids += list(device.cdi_device_ids)
    return ids


def resolve_cdi(names: Sequence[str], spec_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """What a CDI-enabled runtime does with a container's CDI device names: find each in the
    spec files (`*.json`, `*.yaml`) of `spec_dirs` (later directories win), refusing an unknown
    name or one two files of the same directory define. Returns the spec-level then the device
    container edits, in injection order. Raises KubeletError like a failed container create."""
    found: dict[str, tuple[int, Path, dict[str, Any], dict[str, Any]]] = {}
    conflicts: set[str] = set()
    for priority, directory in enumerate(spec_dirs):
        files = sorted(directory.glob("*.json")) + sorted(directory.glob("*.yaml"))
        for path in files:
            spec = yaml.safe_load(path.read_text())  # JSON is YAML
            kind = spec.get("kind")
            for device in spec.get("devices", []):
                qualified = f"{kind}={device.get('name')}"
                seen = found.get(qualified)
                if seen is not None and seen[0] == priority and seen[1] != path:
                    conflicts.add(qualified)
                found[qualified] = (priority, path, spec, device)
    edits: list[dict[str, Any]] = []
    for name in names:
        if name in conflicts:
            raise KubeletError(f"CDI device {name} is defined by more than one spec file")
        if name not in found:
            raise KubeletError(f"unresolvable CDI devices {name}")
        _, _, spec, device = found[name]
        edits += [spec.get("containerEdits") or {}, device.get("containerEdits") or {}]
    return edits
