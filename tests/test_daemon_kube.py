"""The real plugin process with the Kubernetes integration on: a fake API server over HTTP
and a fake pod-resources server, so the daemon's own wiring of ceilings, records, node labels
and Events runs end to end."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deviceplugin.simulate.apiserver import FakeApiServer, pod
from deviceplugin.simulate.inject import inject
from tests.fakes.podresources import Assigned, FakePodResources
from tests.plugin_proc import PluginProcess

TS, SM = "nvidia.com/gpu-fraction", "nvidia.com/gpu-fraction.sm-sharing"
NODE = "node-1"
CONFIG = """\
version: v1
ceilings: allow-overcommit
gpus:
  - match: {index: 0}
    mode: sm-sharing
  - match: {index: 1}
    mode: time-slicing
"""


@pytest.fixture
def cluster(short_tmp: Path) -> Iterator[tuple[FakeApiServer, FakePodResources, PluginProcess]]:
    api = FakeApiServer().start()
    api.add_node(NODE)
    pods = FakePodResources(short_tmp / "pr.sock").start()
    plugin = PluginProcess(short_tmp, config=CONFIG)
    try:
        yield api, pods, plugin
    finally:
        plugin.cleanup()
        pods.stop()
        api.stop()


def test_ceiling_record_labels_and_events_through_the_daemon(
    cluster: tuple[FakeApiServer, FakePodResources, PluginProcess], short_tmp: Path
) -> None:
    api, pods, plugin = cluster
    api.add_pod(
        pod(
            "svc",
            {"app": {SM: 4}},
            annotations={"nvidia.com/container.app.gpu-memory.limit": "8Gi"},
        )
    )
    kubeconfig = api.write_kubeconfig(short_tmp / "kubeconfig")
    plugin.start({"KUBECONFIG": str(kubeconfig), "NODE_NAME": NODE})
    plugin.wait_registered(2)
    assert plugin.kubelet.wait_for(lambda: len(plugin.kubelet.healthy(SM)) == 139, 20)
    assert api.wait_for(lambda s: s.requests_for("GET", "/pods")), "pod cache never listed"

    # node labels and the plan annotation, from the daemon's own publish
    def labels() -> dict[str, str]:
        return dict(api.nodes[NODE]["metadata"].get("labels") or {})

    assert api.wait_for(lambda s: labels().get("gpu-fraction.dev/mode.sm-sharing") == "true", 15)
    assert labels().get("gpu-fraction.dev/mode.time-slicing") == "true"
    assert "gpu-fraction.dev/mode.exclusive" not in labels()
    assert labels().get("gpu-fraction.dev/slice-size") == "1Gi"

    # Allocate reads the ceiling from the pod cache (no network on the gRPC path)
    grant = plugin.kubelet.allocate(SM, 4)
    assert grant.annotations["gpu-fraction.dev/request"] == "4096Mi"
    assert grant.annotations["gpu-fraction.dev/limit"] == "8192Mi"
    ids = tuple(plugin.kubelet.last_allocated)

    # once pod-resources shows who holds the devices, the pod gets its record
    pods.set(Assigned("ns", "svc", "app", SM, ids))

    def record() -> dict[str, object] | None:
        raw = (api.pods[("ns", "svc")]["metadata"].get("annotations") or {}).get(
            "gpu-fraction.dev/allocations"
        )
        return json.loads(raw)["app"] if raw else None

    assert api.wait_for(lambda s: record() is not None, 15), plugin.log.read_text()[-2000:]
    entry = record()
    assert entry is not None
    assert (entry["mode"], entry["requestMiB"], entry["limitMiB"]) == ("sm-sharing", 4096, 8192)
    assert entry["ceilingPolicy"] == "overcommit" and entry["delivery"] == "cdi-edit"

    # a health transition becomes a Node Event with its cause
    inject(plugin.state, "1", "xid", 48)
    assert api.wait_for(
        lambda s: any(
            e.get("involvedObject", {}).get("kind") == "Node" and "xid=48" in e.get("message", "")
            for e in api.events
        ),
        15,
    ), api.events
    assert plugin.terminate() == 0


R580_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "r580.yaml"
SERVING = "gpu-fraction.dev/serving"


def _readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def _wait(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_a_node_that_serves_nothing_is_ready_labelled_and_told_why(
    short_tmp: Path,
) -> None:
    """r580 with `enforcement: required` time-slicing plans nothing: the rollout must not stall
    on /readyz, the node says why, and a config for r580 nodes makes it serve again."""
    api = FakeApiServer().start()
    api.add_node(NODE)
    pods = FakePodResources(short_tmp / "pr.sock").start()
    plugin = PluginProcess(short_tmp, preset="a100x4-r580", config="version: v1\n")
    try:
        kubeconfig = api.write_kubeconfig(short_tmp / "kubeconfig")
        plugin.start({"KUBECONFIG": str(kubeconfig), "NODE_NAME": NODE})
        port = plugin.metrics_port(30)
        assert _wait(lambda: _readyz(port) == 200, 30), plugin.log.read_text()[-3000:]
        assert plugin.kubelet.resources() == [] and plugin.proc is not None
        assert plugin.proc.poll() is None  # keeps running, watching its config

        def labels() -> dict[str, str]:
            return dict(api.nodes[NODE]["metadata"].get("labels") or {})

        assert api.wait_for(lambda s: labels().get(SERVING) == "none", 20), labels()
        assert api.wait_for(
            lambda s: any(
                e.get("involvedObject", {}).get("kind") == "Node"
                and e.get("reason") == "GpuFractionServingNone"
                for e in api.events
            ),
            20,
        ), api.events
        event = next(e for e in api.events if e.get("reason") == "GpuFractionServingNone")
        assert event["type"] == "Warning"
        assert "enforcement required" in event["message"], event["message"]
        assert "580.95.05" in event["message"] and "r615" in event["message"]

        # the shipped r580 config serves these GPUs, and the label goes
        plugin.config.write_text(R580_EXAMPLE.read_text())
        plugin.wait_registered(1, timeout=30)
        assert _wait(lambda: _readyz(port) == 200, 30), plugin.log.read_text()[-3000:]
        assert api.wait_for(lambda s: SERVING not in labels(), 30), labels()
        assert any(
            v == "true" for k, v in labels().items() if k.startswith("gpu-fraction.dev/mode.")
        )
        assert plugin.terminate() == 0
    finally:
        plugin.cleanup()
        pods.stop()
        api.stop()
