"""tests/cluster/figures.py's readings, without a cluster: the agent's own histograms as its
registry exposes them, and its metrics port as its log line writes it."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, generate_latest

from deviceplugin.metrics.families import PluginMetrics
from deviceplugin.plumbing.logs import KeyValueFormatter
from tests.cluster import figures

TS = "nvidia.com/gpu-fraction"


def test_the_agents_histograms_are_read_per_resource_and_bucket() -> None:
    registry = CollectorRegistry()
    metrics = PluginMetrics(registry)
    for ms in [0.3] * 60 + [0.8] * 38 + [7.0] * 2:
        metrics.allocate_latency(TS, ms / 1000)
    metrics.allocate_latency(TS + ".sm-sharing", 0.4)  # another resource: not counted
    for ms in (2.0, 3.0, 40.0):
        metrics.prepare_latency(ms / 1000)
    text = generate_latest(registry).decode()
    alloc = figures.summary(figures.buckets(text, figures.OWN_ALLOC, f'resource="{TS}"'))
    assert alloc["count"] == 100
    assert 0.25 < alloc["p50_ms"] <= 0.5  # inside the bucket that holds the median
    assert 5.0 < alloc["p99_ms"] <= 10.0
    prepare = figures.summary(figures.buckets(text, figures.OWN_PREPARE, ""))
    assert prepare["count"] == 3 and 25.0 < prepare["p99_ms"] <= 50.0


def test_the_metrics_port_is_found_in_the_agents_log_line() -> None:
    record = logging.LogRecord("gpu-fraction.metrics", logging.INFO, "", 0, "metrics serving",
                               None, None)  # fmt: skip
    record.kv = {"host": "127.0.0.1", "port": 40123}
    line = KeyValueFormatter().format(record)
    assert figures.METRICS_PORT.findall(f"other=1\n{line}\n") == ["40123"]
