"""DRA health through the real plugin process (`run --simulate`), the package's DRA kubelet
simulator and the in-test API server: an injected Xid 79 taints its device in the slice within
a second and the taint goes after `--recover` and the quiet period; an application Xid taints
only an sm-sharing GPU (`mps-fault`); the health stream reports the same.
"""

from __future__ import annotations

import calendar
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.dra.slices import DRIVER
from deviceplugin.dra.taints import TAINT_KEY
from deviceplugin.simulate.inject import inject
from tests.test_dra_process import NODE, Node, wait_until

QUIET = 1.0
CONFIG = f"""\
version: v1
api: dra
health: {{quietPeriod: {QUIET}s}}
gpus:
  - {{match: {{index: 0}}, mode: time-slicing}}
  - {{match: {{index: 1}}, mode: sm-sharing}}
"""


@pytest.fixture
def node(short_tmp: Path) -> Iterator[Node]:
    made = Node(short_tmp)
    try:
        yield made
    finally:
        made.close()


def taints(node: Node) -> dict[str, list[dict[str, Any]]]:
    return {d["name"]: d.get("taints") or [] for s in node.slices() for d in s["spec"]["devices"]}


def metric(node: Node, sample: str) -> float | None:
    assert node.plugin is not None
    url = f"http://127.0.0.1:{node.plugin.metrics_port()}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
    return None


def started(node: Node, config: str = CONFIG) -> Node:
    plugin = node.start(config)
    plugin.dra_kubelet.wait_registered(DRIVER, timeout=60)
    wait_until(lambda: node.status().get("slices", {}).get("published"), "slices published")
    # the sm-sharing GPU is `mps-down` until its MPS daemon first answers
    wait_until(lambda: taints(node) == {"gpu-0": [], "gpu-1": []}, "no taints")
    return node


def test_xid_79_taints_its_device_within_a_second_and_recovery_removes_it(node: Node) -> None:
    started(node)
    assert node.plugin is not None
    state = node.plugin.state
    before = node.generation()
    inject(state, "0", "xid", 79)
    injected = time.monotonic()
    wait_until(lambda: taints(node)["gpu-0"], "gpu-0 tainted", timeout=5)
    latency = time.monotonic() - injected
    assert latency < 1.0, f"taint took {latency:.3f} s"
    (t,) = taints(node)["gpu-0"]
    assert (t["key"], t["value"], t["effect"]) == (TAINT_KEY, "xid-79", "NoSchedule")
    added = calendar.timegm(time.strptime(t["timeAdded"], "%Y-%m-%dT%H:%M:%SZ"))
    assert abs(time.time() - added) < 30  # when the fault began
    assert taints(node)["gpu-1"] == []  # the other GPU is untouched
    assert node.generation() > before
    xid_taints = 'gpu_fraction_dra_taints{cause="xid"}'
    republishes = "gpu_fraction_dra_slice_republishes_total"
    scraped = wait_until(
        lambda: metric(node, xid_taints) == 1 and metric(node, republishes), "metrics"
    )
    assert scraped >= 2  # the first publish and the taint
    tainted_at = node.generation()
    inject(state, "0", "recover")
    recovered = time.monotonic()
    wait_until(lambda: not taints(node)["gpu-0"], "taint removed", timeout=15)
    assert time.monotonic() - recovered >= QUIET * 0.9, "removed before the quiet period"
    assert taints(node)["gpu-1"] == []
    assert node.generation() > tainted_at


def test_an_application_xid_taints_only_the_sm_sharing_gpu(node: Node) -> None:
    started(node)
    assert node.plugin is not None
    state = node.plugin.state
    inject(state, "0", "xid", 31)  # time-slicing: its own fault domain, stays healthy
    inject(state, "1", "xid", 31)  # sm-sharing: the MPS server is faulted
    wait_until(lambda: taints(node)["gpu-1"], "gpu-1 tainted", timeout=5)
    (t,) = taints(node)["gpu-1"]
    assert (t["key"], t["value"]) == (TAINT_KEY, "mps-fault")
    time.sleep(0.5)  # the time-slicing GPU's Xid was handled before gpu-1's
    assert taints(node)["gpu-0"] == []


def test_no_execute_is_the_effect_when_configured(node: Node) -> None:
    started(node, CONFIG + "dra: {unhealthyTaintEffect: NoExecute}\n")
    assert node.plugin is not None
    inject(node.plugin.state, "1", "lost")
    wait_until(lambda: taints(node)["gpu-1"], "gpu-1 tainted", timeout=5)
    (t,) = taints(node)["gpu-1"]
    assert (t["value"], t["effect"]) == ("gpu-lost", "NoExecute")


def test_taints_the_api_server_drops_are_reported(node: Node) -> None:
    node.api.dra.drop_taints = True
    started(node)
    assert node.plugin is not None
    inject(node.plugin.state, "0", "xid", 79)
    events = wait_until(
        lambda: [e for e in node.api.events if e["reason"] == "DraFieldsDropped"], "Node Event"
    )
    assert "DRADeviceTaints" in events[0]["message"]
    status = wait_until(
        lambda: node.status().get("slices", {}).get("deviceTaints") is False and node.status(),
        "status",
    )
    assert any(p.endswith("taints") for p in status["slices"]["droppedFields"])
    assert status["slices"]["consumableCapacity"] is True
    assert node.slices()[0]["spec"]["pool"]["name"] == NODE


def health_of(devices: dict[tuple[str, str], Any], name: str) -> tuple[str, str]:
    d = devices[(NODE, name)]
    return d.health, d.message


def test_the_health_stream_reports_the_same_and_recovers(node: Node) -> None:
    started(node)
    assert node.plugin is not None
    kubelet = node.plugin.dra_kubelet
    info = kubelet.info[DRIVER]
    assert list(info.supported_versions) == [
        "v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth",
    ]  # fmt: skip
    assert kubelet.plugin(DRIVER).service == "v1.DRAPlugin"  # type: ignore[union-attr]
    watch = kubelet.watch_health(DRIVER)
    try:
        first = watch.wait_for(lambda d: bool(d), 10)
        assert set(first) == {(NODE, "gpu-0"), (NODE, "gpu-1")}  # the complete list
        assert all(d.timeout_seconds > 0 and d.last_updated > 0 for d in first.values())
        watch.wait_for(lambda d: {v.health for v in d.values()} == {"HEALTHY"}, 10)
        inject(node.plugin.state, "0", "xid", 79)
        got = watch.wait_for(lambda d: d[(NODE, "gpu-0")].health == "UNHEALTHY", 5)
        assert health_of(got, "gpu-0")[0] == "UNHEALTHY"
        message = health_of(got, "gpu-0")[1]
        assert message.startswith("xid-79: xid=79")
        assert health_of(got, "gpu-1") == ("HEALTHY", "")
        inject(node.plugin.state, "1", "xid", 43)  # application Xid, sm-sharing GPU
        got = watch.wait_for(lambda d: d[(NODE, "gpu-1")].health == "UNHEALTHY", 5)
        assert health_of(got, "gpu-1")[1].startswith("mps-fault: ")
        inject(node.plugin.state, "0", "recover")
        got = watch.wait_for(lambda d: d[(NODE, "gpu-0")].health == "HEALTHY", 15)
        assert got[(NODE, "gpu-0")].message == ""
        # never more than 5 sends in any second
        times = list(watch.received_at)
        assert all(sum(1 for u in times[i:] if u - t < 1.0) <= 5 for i, t in enumerate(times))
    finally:
        watch.close()
    assert watch.error is None


def tainted_writes(node: Node) -> list[tuple[int, str, list[str]]]:
    """Every slice write the API server stored that carried a taint: (rv, type, devices)."""
    with node.api.cond:
        history = list(node.api.dra.history)
    return [
        (rv, kind, [d["name"] for d in obj["spec"]["devices"] if d.get("taints")])
        for rv, resource, kind, obj in history
        if resource == "resourceslices" and any(d.get("taints") for d in obj["spec"]["devices"])
    ]


def test_start_and_restart_never_show_a_transient_taint(node: Node) -> None:
    # With NoExecute a transient `mps-down` would evict every pod of a healthy GPU at each
    # plugin upgrade: the sm-sharing device waits for its daemon's first verdict at the first
    # start, and keeps what was published until the adopted daemon is judged after a restart.
    started(node, CONFIG + "dra: {unhealthyTaintEffect: NoExecute}\n")
    plugin = node.plugin
    assert plugin is not None
    assert tainted_writes(node) == []
    before = node.generation()
    assert plugin.terminate() == 0  # the MPS daemon outlives it, as on an upgrade
    plugin.start({"NODE_NAME": NODE, "KUBECONFIG": str(node.root / "kubeconfig")})
    wait_until(lambda: node.log().count("mps daemon adopted") >= 1, "the daemon adopted")
    wait_until(lambda: node.status().get("slices", {}).get("published"), "slices published")
    time.sleep(1.0)  # the restarted plugin's passes after the verdict
    assert taints(node) == {"gpu-0": [], "gpu-1": []}
    assert tainted_writes(node) == []
    assert node.generation() >= before
