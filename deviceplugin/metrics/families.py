"""Prometheus metrics: every family the plugin exports (`server.py` serves them).

`PluginMetrics` owns every metric family on an injected registry: counters and histograms the
daemon and the DRA front-end feed as events happen, plus collectors that read slice,
allocation and DRA snapshots at scrape time (so gauges never go stale).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from deviceplugin.plumbing import logs

_log = logs.get("metrics")

# Allocate and GetPreferredAllocation take well under a millisecond of our own work
# (DESIGN section 7); the default buckets start at 5 ms and would hide everything.
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
# MPS probes spawn the control binary: milliseconds normally, seconds when wedged.
PROBE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# NodePrepareResources: ~13 ms over the simulator, seconds when an MPS daemon must start,
# the kubelet gives up at 45 s.
DRA_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 45.0)
DRA_MODES = ("time-slicing", "sm-sharing", "exclusive")
# Taint causes as metric labels (dra.taints.cause_class): bounded, every one always exported.
TAINT_CLASSES = ("xid", "gpu-lost", "gpu-other", "unmonitored", "mps-down", "mps-fault")


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


class DraCounts(NamedTuple):
    """The DRA front-end at scrape time: prepared claims per mode, taints per cause class."""

    prepared_claims: Mapping[str, int]
    taints: Mapping[str, int]


SlicesSnapshot = Callable[[], Iterable[tuple[str, str, str, str, int]]]
DraSnapshot = Callable[[], DraCounts | None]
AllocationsSnapshot = Callable[[], Iterable[AllocationMemory]]

_ALLOCATION_LABELS = ["resource", "gpu"]
# Only with metrics.podLabels: who runs where is the tenants' business, not every scraper's.
_POD_LABELS = ["namespace", "pod", "container"]


class _SnapshotCollector:
    """Reads the daemon's snapshots at scrape time; a failing callback costs its families only."""

    def __init__(self, errors: Counter) -> None:
        self.slices: SlicesSnapshot | None = None
        self.allocations: AllocationsSnapshot | None = None
        self.dra: DraSnapshot | None = None
        self.pod_labels: Callable[[], bool] = lambda: False
        self._errors = errors

    def describe(self) -> Iterable[Metric]:
        # Without describe() the registry would call collect() while registering.
        return [*self._slice_families(), *self._allocation_families(), *self._dra_families()]

    def collect(self) -> Iterable[Metric]:
        slices = self._slice_families()
        if self.slices is not None:
            try:
                for resource, gpu, health, state, count in self.slices():
                    slices[0].add_metric([resource, gpu, health, state], count)
            except Exception as exc:  # a scrape must never take the plugin down
                self._failed("slices", exc)
                slices = self._slice_families()
        return [*slices, *self._allocations(), *self._dra()]

    def _allocations(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        """Per allocation with pod labels; else per resource and GPU, the allocations summed
        (used only where every one of them is known: never a made-up partial sum)."""
        per_pod = self.pod_labels()
        used, limit = self._allocation_families(per_pod)
        if self.allocations is None:
            return used, limit
        try:
            limits: dict[tuple[str, ...], int] = {}
            useds: dict[tuple[str, ...], int | None] = {}
            for a in self.allocations():
                key: tuple[str, ...] = (a.resource, a.gpu)
                if per_pod:
                    key += (a.namespace, a.pod, a.container)
                limits[key] = limits.get(key, 0) + a.limit_bytes
                before = useds.get(key, 0)
                if before is None or a.used_bytes is None:
                    useds[key] = None
                else:
                    useds[key] = before + a.used_bytes
            for key, total in limits.items():
                limit.add_metric(list(key), total)
                if (value := useds[key]) is not None:
                    used.add_metric(list(key), value)
        except Exception as exc:
            self._failed("allocations", exc)
            return self._allocation_families(per_pod)
        return used, limit

    def _dra(self) -> list[GaugeMetricFamily]:
        """No samples without a DRA front-end (no DRA GPUs, or DRA not served)."""
        prepared, taints = self._dra_families()
        if self.dra is None:
            return [prepared, taints]
        try:
            counts = self.dra()
            if counts is None:
                return [prepared, taints]
            for mode in DRA_MODES:
                prepared.add_metric([mode], counts.prepared_claims.get(mode, 0))
            for cls in TAINT_CLASSES:
                taints.add_metric([cls], counts.taints.get(cls, 0))
        except Exception as exc:
            self._failed("dra", exc)
            return list(self._dra_families())
        return [prepared, taints]

    @staticmethod
    def _dra_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        prepared = GaugeMetricFamily(
            "gpu_fraction_dra_prepared_claims",
            "ResourceClaims prepared on this node, by the mode of their devices.",
            labels=["mode"],
        )
        taints = GaugeMetricFamily(
            "gpu_fraction_dra_taints",
            "DRA devices published with the unhealthy taint, by cause class.",
            labels=["cause"],
        )
        return prepared, taints

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
    def _allocation_families(
        per_pod: bool = False,
    ) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        labels = _ALLOCATION_LABELS + (_POD_LABELS if per_pod else [])
        used = GaugeMetricFamily(
            "gpu_fraction_allocation_memory_used_bytes",
            "GPU memory used by allocations' processes, where NVML process lists allow.",
            labels=labels,
        )
        limit = GaugeMetricFamily(
            "gpu_fraction_allocation_memory_limit_bytes",
            "GPU memory ceiling (limit) of allocations.",
            labels=labels,
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
        self._children: dict[tuple[int, str], Histogram] = {}
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
        self._dra_prepare = Histogram(
            "gpu_fraction_dra_prepare_duration_seconds",
            "Time spent answering the kubelet's NodePrepareResources (all its claims).",
            buckets=DRA_BUCKETS,
            registry=registry,
        )
        self._dra_unprepare = Histogram(
            "gpu_fraction_dra_unprepare_duration_seconds",
            "Time spent answering the kubelet's NodeUnprepareResources.",
            buckets=DRA_BUCKETS,
            registry=registry,
        )
        self._dra_status_abandoned = Counter(
            "gpu_fraction_dra_claim_status_abandoned",
            "Claim status writes given up on a permanent refusal (a 4xx other than 409/429), "
            "by HTTP status.",
            ["code"],
            registry=registry,
        )
        self._dra_republishes = Counter(
            "gpu_fraction_dra_slice_republishes",
            "ResourceSlice writes of this node's pool at a new generation.",
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

    def attach_allocations(
        self, snapshot: AllocationsSnapshot | None, pod_labels: Callable[[], bool] | None = None
    ) -> None:
        """Set (or replace) the callback behind the allocation memory gauges; `pod_labels`
        (read at each scrape: metrics.podLabels) adds namespace, pod and container."""
        self._collector.allocations = snapshot
        if pod_labels is not None:
            self._collector.pod_labels = pod_labels

    def attach_dra(self, snapshot: DraSnapshot | None) -> None:
        """Set the callback behind the DRA gauges (prepared claims, taints)."""
        self._collector.dra = snapshot

    def prepare_latency(self, seconds: float) -> None:
        self._dra_prepare.observe(seconds)

    def unprepare_latency(self, seconds: float) -> None:
        self._dra_unprepare.observe(seconds)

    def slice_republished(self) -> None:
        self._dra_republishes.inc()

    def claim_status_abandoned(self, code: int | None) -> None:
        self._dra_status_abandoned.labels(code=str(code)).inc()

    def allocate_latency(self, resource: str, seconds: float) -> None:
        self._child(self._allocate, resource).observe(seconds)

    def preferred_latency(self, resource: str, seconds: float) -> None:
        self._child(self._preferred, resource).observe(seconds)

    def _child(self, histogram: Histogram, resource: str) -> Histogram:
        # labels() validates and locks on every call, and these sit on the reply path
        key = (id(histogram), resource)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = histogram.labels(resource=resource)
        return child

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
