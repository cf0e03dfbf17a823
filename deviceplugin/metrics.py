"""Prometheus metrics and the plugin's HTTP endpoints (`/metrics`, `/healthz`, `/readyz`).

`PluginMetrics` owns every metric family on an injected registry: counters and histograms the
daemon feeds as events happen, plus collectors that read slice and allocation snapshots at
scrape time (so gauges never go stale). `MetricsServer` serves them on `--metrics-address`.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from deviceplugin import logs

_log = logs.get("metrics")

# Allocate and GetPreferredAllocation take well under a millisecond of our own work
# (DESIGN section 7); the default buckets start at 5 ms and would hide everything.
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
# MPS probes spawn the control binary: milliseconds normally, seconds when wedged.
PROBE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class SliceCount(NamedTuple):
    """How many slices of one resource on one GPU share a health and allocation state."""

    resource: str
    gpu: str
    health: str  # "Healthy" | "Unhealthy"
    state: str  # "free" | "allocated"
    slices: int


class AllocationMemory(NamedTuple):
    """One live allocation's memory: used is None when NVML process lists cannot tell."""

    resource: str
    gpu: str
    namespace: str
    pod: str
    container: str
    used_bytes: int | None
    limit_bytes: int


SlicesSnapshot = Callable[[], Iterable[tuple[str, str, str, str, int]]]
AllocationsSnapshot = Callable[[], Iterable[AllocationMemory]]

_ALLOCATION_LABELS = ["resource", "gpu", "namespace", "pod", "container"]


class _SnapshotCollector:
    """Reads the daemon's snapshots at scrape time; a failing callback costs its families only."""

    def __init__(self, errors: Counter) -> None:
        self.slices: SlicesSnapshot | None = None
        self.allocations: AllocationsSnapshot | None = None
        self._errors = errors

    def describe(self) -> Iterable[Metric]:
        # Without describe() the registry would call collect() while registering.
        return [*self._slice_families(), *self._allocation_families()]

    def collect(self) -> Iterable[Metric]:
        slices = self._slice_families()
        if self.slices is not None:
            try:
                for resource, gpu, health, state, count in self.slices():
                    slices[0].add_metric([resource, gpu, health, state], count)
            except Exception as exc:  # a scrape must never take the plugin down
                self._failed("slices", exc)
                slices = self._slice_families()
        used, limit = self._allocation_families()
        if self.allocations is not None:
            try:
                for a in self.allocations():
                    labels = [a.resource, a.gpu, a.namespace, a.pod, a.container]
                    limit.add_metric(labels, a.limit_bytes)
                    if a.used_bytes is not None:
                        used.add_metric(labels, a.used_bytes)
            except Exception as exc:
                self._failed("allocations", exc)
                used, limit = self._allocation_families()
        return [*slices, used, limit]

    def _failed(self, source: str, exc: Exception) -> None:
        self._errors.labels(source=source).inc()
        logs.log(_log, "metrics snapshot failed", source=source, error=repr(exc))

    @staticmethod
    def _slice_families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "gpu_fraction_slices",
                "Advertised slices per resource and GPU, by health and allocation state.",
                labels=["resource", "gpu", "health", "state"],
            )
        ]

    @staticmethod
    def _allocation_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        used = GaugeMetricFamily(
            "gpu_fraction_allocation_memory_used_bytes",
            "GPU memory used by an allocation's processes, where NVML process lists allow.",
            labels=_ALLOCATION_LABELS,
        )
        limit = GaugeMetricFamily(
            "gpu_fraction_allocation_memory_limit_bytes",
            "GPU memory ceiling (limit) of an allocation.",
            labels=_ALLOCATION_LABELS,
        )
        return used, limit


class PluginMetrics:
    """Every metric the plugin exports, on the registry it is given (never the global one)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        slices_snapshot: SlicesSnapshot | None = None,
        allocations_snapshot: AllocationsSnapshot | None = None,
    ) -> None:
        self._allocate = Histogram(
            "gpu_fraction_allocate_duration_seconds",
            "Time spent answering the kubelet's Allocate.",
            ["resource"],
            buckets=RPC_BUCKETS,
            registry=registry,
        )
        self._preferred = Histogram(
            "gpu_fraction_preferred_allocation_duration_seconds",
            "Time spent answering the kubelet's GetPreferredAllocation.",
            ["resource"],
            buckets=RPC_BUCKETS,
            registry=registry,
        )
        self._refused = Counter(
            "gpu_fraction_allocations_refused",
            "Allocate calls refused, by reason.",
            ["resource", "reason"],
            registry=registry,
        )
        self._registered = Counter(
            "gpu_fraction_registrations",
            "Successful registrations with the kubelet.",
            ["resource"],
            registry=registry,
        )
        self._kubelet_restarts = Counter(
            "gpu_fraction_kubelet_restarts",
            "Kubelet restarts seen (kubelet.sock re-created).",
            registry=registry,
        )
        self._transitions = Counter(
            "gpu_fraction_health_transitions",
            "Health transitions, by fault domain, cause class and the health reached.",
            ["domain", "cause", "to"],
            registry=registry,
        )
        self._mps_restarts = Counter(
            "gpu_fraction_mps_daemon_restarts",
            "MPS control daemon restarts by the supervisor.",
            ["gpu"],
            registry=registry,
        )
        self._mps_probe = Histogram(
            "gpu_fraction_mps_probe_duration_seconds",
            "Duration of MPS control daemon liveness probes.",
            ["gpu"],
            buckets=PROBE_BUCKETS,
            registry=registry,
        )
        scrape_errors = Counter(
            "gpu_fraction_metrics_snapshot_errors",
            "Scrapes in which a snapshot callback failed, by source.",
            ["source"],
            registry=None,
        )
        self._collector = _SnapshotCollector(scrape_errors)
        self._collector.slices = slices_snapshot
        self._collector.allocations = allocations_snapshot
        registry.register(self._collector)
        # After the collector, so a scrape reports the errors of that same scrape.
        registry.register(scrape_errors)

    def attach_slices(self, snapshot: SlicesSnapshot | None) -> None:
        """Set (or replace) the callback behind `gpu_fraction_slices`."""
        self._collector.slices = snapshot

    def attach_allocations(self, snapshot: AllocationsSnapshot | None) -> None:
        """Set (or replace) the callback behind the per-allocation memory gauges."""
        self._collector.allocations = snapshot

    def allocate_latency(self, resource: str, seconds: float) -> None:
        self._allocate.labels(resource=resource).observe(seconds)

    def preferred_latency(self, resource: str, seconds: float) -> None:
        self._preferred.labels(resource=resource).observe(seconds)

    def refused(self, resource: str, reason: str) -> None:
        self._refused.labels(resource=resource, reason=reason).inc()

    def registered(self, resource: str) -> None:
        self._registered.labels(resource=resource).inc()

    def kubelet_restart(self) -> None:
        self._kubelet_restarts.inc()

    def health_transition(self, domain: str, cause_class: str, healthy: bool = False) -> None:
        to = "Healthy" if healthy else "Unhealthy"
        self._transitions.labels(domain=str(domain), cause=cause_class, to=to).inc()

    def mps_restart(self, gpu: str) -> None:
        self._mps_restarts.labels(gpu=gpu).inc()

    def mps_probe_latency(self, gpu: str, seconds: float) -> None:
        self._mps_probe.labels(gpu=gpu).observe(seconds)


class MetricsAddressError(ValueError):
    """A `--metrics-address` that is not `[host]:port`."""


def parse_address(address: str) -> tuple[str, int]:
    """`:9447` → ("", 9447); `127.0.0.1:0`; `[::1]:9447` → ("::1", 9447)."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit():
        raise MetricsAddressError(f"metrics address {address!r}: expected [host]:port")
    port = int(port_text)
    if port > 65535:
        raise MetricsAddressError(f"metrics address {address!r}: port out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise MetricsAddressError(f"metrics address {address!r}: write IPv6 hosts as [host]:port")
    return host, port


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family
        super().__init__(address, _Handler, bind_and_activate=False)
        self.registry: CollectorRegistry | None = None
        self.ready: Callable[[], bool] = lambda: False
        if family == socket.AF_INET6:
            # An empty host means every address, IPv4 included (dual stack).
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            self.server_bind()
            self.server_activate()
        except BaseException:
            self.server_close()
            raise

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN (a DNS lookup at start); skip it.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            assert self.server.registry is not None
            self._reply(200, encoder(self.server.registry), content_type)
        elif path == "/healthz":
            self._reply(200, b"ok\n")
        elif path == "/readyz":
            try:
                ready = self.server.ready()
            except Exception as exc:
                logs.log(_log, "readiness check failed", error=repr(exc))
                ready = False
            self._reply(200, b"ready\n") if ready else self._reply(503, b"not ready\n")
        else:
            self._reply(404, b"not found\n")

    def _reply(
        self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8"
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        # Probes hit this every few seconds; access logs would drown the event log.
        pass


class MetricsServer:
    """`/metrics`, `/healthz` (process alive) and `/readyz` (`ready()` true) over HTTP."""

    def __init__(
        self, address: str, registry: CollectorRegistry, ready: Callable[[], bool]
    ) -> None:
        self._host, self._port = parse_address(address)
        self._registry = registry
        self._ready = ready
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        """The bound port once started (useful with port 0), else the configured one."""
        if self._server is not None:
            return int(self._server.server_address[1])
        return self._port

    def start(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            server = self._bind()
            server.registry = self._registry
            server.ready = self._ready
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever, name="metrics-http", daemon=True
            )
            self._thread.start()
        logs.log(_log, "metrics serving", host=self._host or "*", port=self.port)

    def stop(self) -> None:
        with self._lock:
            server, thread = self._server, self._thread
            self._server, self._thread = None, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def _bind(self) -> _Server:
        if self._host == "":
            if socket.has_ipv6:
                with contextlib.suppress(OSError):
                    return _Server(("::", self._port), socket.AF_INET6)
            return _Server(("0.0.0.0", self._port), socket.AF_INET)
        infos = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
        return _Server((str(sockaddr[0]), self._port), family)
