"""Figures from the real kubelet (`make bench` runs this after the simulator benchmarks).

On a fresh node with the real plugin: pod create → Running for pods without our resources,
with `nvidia.com/gpu-fraction: 1`, and with a 1Gi DRA claim, one pod after another (timed by
a watch inside the cluster's namespaces, `podtimer.py`); then the kubelet's own histograms of
our Allocate (`kubelet_device_plugin_alloc_duration_seconds`) and NodePrepareResources
(`dra_grpc_operations_duration_seconds`, method NodePrepareResources) calls, read from its
/metrics through the API server, and the agent's own histograms of the same calls (finer
buckets: how much of the kubelet's figure is our handler). Prints a table and writes JSON.

    python -m tests.cluster.figures [--pods 50] [--plain 20] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.cluster.agent import Agent, serving_agent
from tests.cluster.conftest import LOCK
from tests.cluster.kube import Cluster
from tests.cluster.requirements import REPO, missing, version

ALLOC = "kubelet_device_plugin_alloc_duration_seconds"
DRA_GRPC = "dra_grpc_operations_duration_seconds"
PREPARE = "NodePrepareResources"
# The agent's own histograms of the same two calls (deviceplugin/metrics/families.py).
OWN_ALLOC = "gpu_fraction_allocate_duration_seconds"
OWN_PREPARE = "gpu_fraction_dra_prepare_duration_seconds"
# The agent's "metrics serving" log line (deviceplugin/metrics/server.py), its port.
METRICS_PORT = re.compile(r'msg="?metrics serving"? .*?\bport=(\d+)')


def buckets(metrics: str, name: str, match: str) -> list[tuple[float, float]]:
    """Cumulative (le, count) of histogram `name`, summed over the series whose labels
    contain `match`."""
    out: dict[float, float] = {}
    for line in metrics.splitlines():
        m = re.match(rf"{name}_bucket\{{(.*)\}} (\S+)$", line)
        if not m or match not in m.group(1):
            continue
        le = re.search(r'le="([^"]+)"', m.group(1))
        assert le is not None
        bound = math.inf if le.group(1) == "+Inf" else float(le.group(1))
        out[bound] = out.get(bound, 0.0) + float(m.group(2))
    return sorted(out.items())


def quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket that holds rank q."""
    if not cumulative or cumulative[-1][1] == 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return None


def timed(cluster: Cluster, kind: str, count: int) -> list[float]:
    out = subprocess.run(
        cluster.argv("env", f"PYTHONPATH={REPO}", sys.executable, "-m", "tests.cluster.podtimer",
                     kind, str(count)),
        capture_output=True, text=True, timeout=60 + 30 * count,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"podtimer {kind}: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    return list(json.loads(out.stdout.splitlines()[-1])[kind])


def own_metrics(cluster: Cluster, agent: Agent) -> str:
    """The agent's /metrics, read inside the cluster's network namespace at the port it
    logged."""
    ports = METRICS_PORT.findall(agent.log.read_text())
    if not ports:
        raise SystemExit(f"the agent logged no metrics port:\n{agent.tail()}")
    fetch = (
        "import sys, urllib.request; "
        "sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())"
    )
    out = subprocess.run(
        cluster.argv(sys.executable, "-c", fetch, f"http://127.0.0.1:{ports[-1]}/metrics"),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"the agent's metrics: {out.stderr[-2000:]}")
    return out.stdout


def summary(cumulative: list[tuple[float, float]]) -> dict[str, Any]:
    return {
        "count": cumulative[-1][1] if cumulative else 0,
        "p50_ms": _ms(quantile(0.5, cumulative)),
        "p99_ms": _ms(quantile(0.99, cumulative)),
    }


def measure(cluster: Cluster, agent: Agent, pods: int, plain: int) -> dict[str, Any]:
    startup = {
        "plain": timed(cluster, "plain", plain),
        "dp": timed(cluster, "dp", pods),
        "dra": timed(cluster, "dra", pods),
    }
    metrics = cluster.kubectl("get", "--raw", f"/api/v1/nodes/{cluster.node}/proxy/metrics").stdout
    alloc = buckets(metrics, ALLOC, 'resource_name="nvidia.com/gpu-fraction"')
    prepare = buckets(metrics, DRA_GRPC, PREPARE)
    own = own_metrics(cluster, agent)
    median = {k: statistics.median(v) for k, v in startup.items()}
    return {
        "kubernetes": cluster.version,
        "kubelet": {
            ALLOC: summary(alloc),
            f"{DRA_GRPC}{{{PREPARE}}}": summary(prepare),
        },
        "agent": {
            OWN_ALLOC: summary(buckets(own, OWN_ALLOC, 'resource="nvidia.com/gpu-fraction"')),
            OWN_PREPARE: summary(buckets(own, OWN_PREPARE, "")),
        },
        "pod_running_s": {
            k: {
                "n": len(v),
                "median": round(median[k], 3),
                "p90": round(sorted(v)[int(0.9 * (len(v) - 1))], 3),
            }
            for k, v in startup.items()
        },
        "ratio_to_plain": {k: round(median[k] / median["plain"], 2) for k in ("dp", "dra")},
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pods", type=int, default=50)
    parser.add_argument("--plain", type=int, default=20)
    parser.add_argument("--json-out", type=Path, default=Path("bench-results/cluster.json"))
    args = parser.parse_args(argv)
    why = missing()
    if why is not None:
        print(f"cluster figures: skipped ({why})")
        return 0
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cluster = Cluster.up(version())
        try:
            with serving_agent(cluster) as agent:
                result = measure(cluster, agent, args.pods, args.plain)
        finally:
            cluster.down()
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
