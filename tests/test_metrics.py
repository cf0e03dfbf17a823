"""Metrics scraped over real HTTP from MetricsServer: names, labels and values, and the probes."""

from __future__ import annotations

import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.metrics.families import (
    TAINT_CLASSES,
    AllocationMemory,
    DraCounts,
    PluginMetrics,
    SliceCount,
)
from deviceplugin.metrics.server import MetricsAddressError, MetricsServer, parse_address

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"
TS = "nvidia.com/gpu-fraction"
SM = "nvidia.com/gpu-fraction.sm-sharing"


def get(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(
    parsed: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return parsed[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def served(registry: CollectorRegistry) -> Iterator[tuple[MetricsServer, list[bool]]]:
    readiness = [False]
    server = MetricsServer("127.0.0.1:0", registry, ready=lambda: readiness[0])
    server.start()
    yield server, readiness
    server.stop()


def test_counters_and_histograms_scraped_with_labels_and_values(
    registry: CollectorRegistry, served: tuple[MetricsServer, list[bool]]
) -> None:
    metrics = PluginMetrics(registry)
    server, _ = served
    for seconds in (0.0002, 0.0004, 0.003):
        metrics.allocate_latency(TS, seconds)
    metrics.preferred_latency(SM, 0.00005)
    metrics.refused(TS, "multi-gpu")
    metrics.refused(TS, "multi-gpu")
    metrics.refused(SM, "client-limit")
    metrics.registered(TS)
    metrics.registered(TS)
    metrics.kubelet_restart()
    metrics.health_transition("gpu", "reset")
    metrics.health_transition("gpu", "reset", healthy=True)
    metrics.mps_restart(GPU1)
    metrics.mps_probe_latency(GPU1, 0.02)

    status, ctype, body = get(server.port, "/metrics")
    assert status == 200
    assert ctype.startswith("text/plain")
    parsed = samples(body)
    assert value(parsed, "gpu_fraction_allocate_duration_seconds_count", resource=TS) == 3
    assert value(
        parsed, "gpu_fraction_allocate_duration_seconds_sum", resource=TS
    ) == pytest.approx(0.0036)
    # Sub-millisecond buckets exist so Allocate's real latencies are visible.
    assert (
        value(parsed, "gpu_fraction_allocate_duration_seconds_bucket", resource=TS, le="0.0005")
        == 2
    )
    assert (
        value(parsed, "gpu_fraction_allocate_duration_seconds_bucket", resource=TS, le="+Inf") == 3
    )
    assert (
        value(parsed, "gpu_fraction_preferred_allocation_duration_seconds_count", resource=SM) == 1
    )
    assert (
        value(parsed, "gpu_fraction_allocations_refused_total", resource=TS, reason="multi-gpu")
        == 2
    )
    assert (
        value(parsed, "gpu_fraction_allocations_refused_total", resource=SM, reason="client-limit")
        == 1
    )
    assert value(parsed, "gpu_fraction_registrations_total", resource=TS) == 2
    assert value(parsed, "gpu_fraction_kubelet_restarts_total") == 1
    assert (
        value(
            parsed,
            "gpu_fraction_health_transitions_total",
            domain="gpu",
            cause="reset",
            to="Unhealthy",
        )
        == 1
    )
    assert (
        value(
            parsed,
            "gpu_fraction_health_transitions_total",
            domain="gpu",
            cause="reset",
            to="Healthy",
        )
        == 1
    )
    assert value(parsed, "gpu_fraction_mps_daemon_restarts_total", gpu=GPU1) == 1
    assert value(parsed, "gpu_fraction_mps_probe_duration_seconds_sum", gpu=GPU1) == pytest.approx(
        0.02
    )


def test_snapshot_collectors_read_callbacks_at_each_scrape(
    registry: CollectorRegistry, served: tuple[MetricsServer, list[bool]]
) -> None:
    server, _ = served
    state: list[SliceCount] = [
        SliceCount(TS, GPU0, "Healthy", "free", 100),
        SliceCount(TS, GPU0, "Healthy", "allocated", 40),
    ]
    allocations = [
        AllocationMemory(TS, GPU0, "ns", "web", "app", 3 * 2**30, 4 * 2**30),
        AllocationMemory(SM, GPU1, "ns", "batch", "worker", None, 2 * 2**30),
    ]
    metrics = PluginMetrics(registry, slices_snapshot=lambda: list(state))
    metrics.attach_allocations(lambda: allocations, pod_labels=lambda: True)

    parsed = samples(get(server.port, "/metrics")[2])
    labels = {"resource": TS, "gpu": GPU0, "health": "Healthy"}
    assert value(parsed, "gpu_fraction_slices", state="free", **labels) == 100
    assert value(parsed, "gpu_fraction_slices", state="allocated", **labels) == 40
    web = {"resource": TS, "gpu": GPU0, "namespace": "ns", "pod": "web", "container": "app"}
    assert value(parsed, "gpu_fraction_allocation_memory_used_bytes", **web) == 3 * 2**30
    assert value(parsed, "gpu_fraction_allocation_memory_limit_bytes", **web) == 4 * 2**30
    batch = {"resource": SM, "gpu": GPU1, "namespace": "ns", "pod": "batch", "container": "worker"}
    assert value(parsed, "gpu_fraction_allocation_memory_limit_bytes", **batch) == 2 * 2**30
    # No NVML process data: no used sample rather than a made-up zero.
    assert ("gpu_fraction_allocation_memory_used_bytes", tuple(sorted(batch.items()))) not in parsed

    # A fault moves slices to Unhealthy: the next scrape shows it, nothing stale remains.
    state[:] = [SliceCount(TS, GPU0, "Unhealthy", "free", 100)]
    parsed = samples(get(server.port, "/metrics")[2])
    assert (
        value(parsed, "gpu_fraction_slices", state="free", **{**labels, "health": "Unhealthy"})
        == 100
    )
    assert ("gpu_fraction_slices", tuple(sorted({**labels, "state": "free"}.items()))) not in parsed


def test_allocation_gauges_name_no_pod_unless_configured(
    registry: CollectorRegistry, served: tuple[MetricsServer, list[bool]]
) -> None:
    server, _ = served
    allocations = [
        AllocationMemory(TS, GPU0, "tenant-a", "web", "app", 3 * 2**30, 4 * 2**30),
        AllocationMemory(TS, GPU0, "tenant-b", "db", "main", 1 * 2**30, 2 * 2**30),
        AllocationMemory(SM, GPU1, "tenant-c", "batch", "worker", None, 2 * 2**30),
        AllocationMemory(SM, GPU1, "tenant-d", "etl", "worker", 2**30, 2**30),
    ]
    per_pod = [False]
    metrics = PluginMetrics(registry)
    metrics.attach_allocations(lambda: allocations, pod_labels=lambda: per_pod[0])
    text = get(server.port, "/metrics")[2]
    for name in ("tenant-", "web", "batch", 'pod="', 'namespace="'):
        assert name not in text, name
    parsed = samples(text)
    ts, sm = {"resource": TS, "gpu": GPU0}, {"resource": SM, "gpu": GPU1}
    assert value(parsed, "gpu_fraction_allocation_memory_limit_bytes", **ts) == 6 * 2**30
    assert value(parsed, "gpu_fraction_allocation_memory_used_bytes", **ts) == 4 * 2**30
    assert value(parsed, "gpu_fraction_allocation_memory_limit_bytes", **sm) == 3 * 2**30
    # One allocation's use unknown: no sum that would pass for the whole GPU's.
    assert ("gpu_fraction_allocation_memory_used_bytes", tuple(sorted(sm.items()))) not in parsed
    per_pod[0] = True  # metrics.podLabels, read at each scrape (a reload needs no restart)
    text = get(server.port, "/metrics")[2]
    assert 'namespace="tenant-a"' in text and 'pod="web"' in text


def test_failing_snapshot_does_not_break_the_scrape(
    registry: CollectorRegistry, served: tuple[MetricsServer, list[bool]]
) -> None:
    server, _ = served

    def broken() -> list[SliceCount]:
        raise RuntimeError("plan not ready")

    metrics = PluginMetrics(registry, slices_snapshot=broken)
    metrics.registered(TS)
    status, _, body = get(server.port, "/metrics")
    assert status == 200
    parsed = samples(body)
    assert value(parsed, "gpu_fraction_registrations_total", resource=TS) == 1
    assert value(parsed, "gpu_fraction_metrics_snapshot_errors_total", source="slices") == 1
    assert not any(name == "gpu_fraction_slices" for name, _ in parsed)


def test_every_family_follows_prometheus_naming(registry: CollectorRegistry) -> None:
    PluginMetrics(registry, slices_snapshot=lambda: [], allocations_snapshot=lambda: [])
    families = {f.name: f.type for f in registry.collect()}
    assert families, "no metric families registered"
    for name, kind in families.items():
        assert name.startswith("gpu_fraction_"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name
        if kind == "gauge" and "memory" in name:
            assert name.endswith("_bytes"), name
    # Counters are exposed with the `_total` suffix (the family name drops it).
    exposed = generate_latest(registry).decode().splitlines()
    for name in (n for n, k in families.items() if k == "counter"):
        assert f"# TYPE {name}_total counter" in exposed, name


def test_two_instances_on_separate_registries_do_not_collide() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    PluginMetrics(first).kubelet_restart()
    PluginMetrics(second)
    assert first.get_sample_value("gpu_fraction_kubelet_restarts_total") == 1
    assert second.get_sample_value("gpu_fraction_kubelet_restarts_total") == 0


def test_healthz_and_readyz_follow_the_ready_callback(
    registry: CollectorRegistry, served: tuple[MetricsServer, list[bool]]
) -> None:
    server, readiness = served
    assert get(server.port, "/healthz")[0] == 200
    assert get(server.port, "/readyz")[0] == 503
    readiness[0] = True
    assert get(server.port, "/readyz")[0] == 200
    assert get(server.port, "/nope")[0] == 404


def test_readyz_is_not_ready_when_the_check_raises(registry: CollectorRegistry) -> None:
    def boom() -> bool:
        raise RuntimeError("lost")

    server = MetricsServer("127.0.0.1:0", registry, ready=boom)
    server.start()
    try:
        assert get(server.port, "/readyz")[0] == 503
        assert get(server.port, "/healthz")[0] == 200
    finally:
        server.stop()


def test_start_and_stop_are_idempotent_and_release_the_port(registry: CollectorRegistry) -> None:
    server = MetricsServer("127.0.0.1:0", registry, ready=lambda: True)
    server.stop()  # before start: nothing to do
    server.start()
    port = server.port
    server.start()
    assert server.port == port
    assert get(port, "/healthz")[0] == 200
    server.stop()
    server.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def test_all_interfaces_address_serves_loopback(registry: CollectorRegistry) -> None:
    server = MetricsServer(":0", registry, ready=lambda: True)
    server.start()
    try:
        assert server.port != 0
        assert get(server.port, "/healthz")[0] == 200
    finally:
        server.stop()


def test_port_in_use_is_an_error(registry: CollectorRegistry) -> None:
    first = MetricsServer("127.0.0.1:0", registry, ready=lambda: True)
    first.start()
    try:
        second = MetricsServer(f"127.0.0.1:{first.port}", registry, ready=lambda: True)
        with pytest.raises(OSError):
            second.start()
        second.stop()
    finally:
        first.stop()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (":9447", ("", 9447)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:9447", ("::1", 9447)),
        ("localhost:80", ("localhost", 80)),
    ],
)
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["9447", ":", "host:port", ":65536", "::1:9447", ""])
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(MetricsAddressError):
        parse_address(text)


def test_docs_list_every_metric_and_no_other(registry: CollectorRegistry) -> None:
    PluginMetrics(registry, slices_snapshot=lambda: [], allocations_snapshot=lambda: [])
    exposed = {f.name + ("_total" if f.type == "counter" else "") for f in registry.collect()}
    docs = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
    rows = re.findall(r"^\| `(gpu_fraction_[a-z_]+)` \|", docs.read_text(), re.MULTILINE)
    assert sorted(rows) == sorted(exposed)


def test_dra_families_scraped_with_labels_and_values(
    registry: CollectorRegistry, served: tuple[MetricsServer, list[bool]]
) -> None:
    server, _ = served
    metrics = PluginMetrics(registry)
    _, _, text = get(server.port, "/metrics")
    assert "gpu_fraction_dra_prepared_claims" not in text.replace("# HELP", "").split("# TYPE")[0]
    assert not [k for k in samples(text) if k[0] in ("gpu_fraction_dra_taints",)]  # no DRA
    counts = DraCounts({"sm-sharing": 2, "exclusive": 1}, {"xid": 1, "mps-fault": 3})
    metrics.attach_dra(lambda: counts)
    for seconds in (0.004, 0.02, 0.02):
        metrics.prepare_latency(seconds)
    metrics.unprepare_latency(0.0005)
    metrics.slice_republished()
    metrics.slice_republished()
    metrics.claim_status_abandoned(403)
    _, _, text = get(server.port, "/metrics")
    parsed = samples(text)
    assert value(parsed, "gpu_fraction_dra_claim_status_abandoned_total", code="403") == 1
    assert value(parsed, "gpu_fraction_dra_prepared_claims", mode="sm-sharing") == 2
    assert value(parsed, "gpu_fraction_dra_prepared_claims", mode="exclusive") == 1
    assert value(parsed, "gpu_fraction_dra_prepared_claims", mode="time-slicing") == 0
    assert value(parsed, "gpu_fraction_dra_taints", cause="xid") == 1
    assert value(parsed, "gpu_fraction_dra_taints", cause="mps-fault") == 3
    assert value(parsed, "gpu_fraction_dra_taints", cause="gpu-lost") == 0
    taint_labels = {k[1] for k in parsed if k[0] == "gpu_fraction_dra_taints"}
    assert taint_labels == {(("cause", c),) for c in TAINT_CLASSES}  # bounded, all exported
    assert value(parsed, "gpu_fraction_dra_prepare_duration_seconds_count") == 3
    assert value(parsed, "gpu_fraction_dra_prepare_duration_seconds_bucket", le="0.005") == 1
    assert value(parsed, "gpu_fraction_dra_prepare_duration_seconds_sum") == pytest.approx(0.044)
    assert value(parsed, "gpu_fraction_dra_unprepare_duration_seconds_bucket", le="0.001") == 1
    assert value(parsed, "gpu_fraction_dra_slice_republishes_total") == 2
    # a failing DRA snapshot costs its own families only, and is counted
    metrics.attach_dra(lambda: 1 / 0)  # type: ignore[arg-type,return-value]
    parsed = samples(get(server.port, "/metrics")[2])
    assert not [k for k in parsed if k[0] == "gpu_fraction_dra_taints"]
    assert value(parsed, "gpu_fraction_metrics_snapshot_errors_total", source="dra") == 1
    assert value(parsed, "gpu_fraction_dra_slice_republishes_total") == 2
