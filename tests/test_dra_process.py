"""The DRA front-end through the real plugin process (`run --simulate`), the package's DRA
kubelet simulator and the in-test API server: registration and re-registration, slices
published / wiped / republished, dropped fields reported, one node serving GPU 0 through the
device-plugin API and GPU 1 through DRA (never both), and no DRA without credentials.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.dra.frontend import STATUS_FILE
from deviceplugin.dra.slices import DRIVER
from deviceplugin.simulate.apiserver import FakeApiServer
from tests.plugin_proc import PluginProcess

NODE = "node-1"
ALL_DRA = "version: v1\napi: dra\n"
GPU1_ON_DRA = """\
version: v1
gpus:
  - match: {index: 0}
    mode: time-slicing
  - match: {index: 1}
    mode: time-slicing
    api: dra
"""


def wait_until(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


class Node:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.api = FakeApiServer().start()
        self.api.add_node(NODE)
        self.plugin: PluginProcess | None = None

    def start(self, config: str, credentials: bool = True) -> PluginProcess:
        self.plugin = PluginProcess(self.root, config=config)
        self.plugin.dra_kubelet.start()
        env = {"NODE_NAME": NODE}
        if credentials:
            env["KUBECONFIG"] = str(self.api.write_kubeconfig(self.root / "kubeconfig"))
        self.plugin.start(env)
        return self.plugin

    def slices(self) -> list[dict[str, Any]]:
        return self.api.dra.slices_of(NODE)

    def generation(self) -> int:
        return max((s["spec"]["pool"]["generation"] for s in self.slices()), default=0)

    def log(self) -> str:
        assert self.plugin is not None
        return self.plugin.log.read_text()

    def status(self) -> dict[str, Any]:
        assert self.plugin is not None
        path = self.plugin.state / STATUS_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def readyz(self) -> int:
        assert self.plugin is not None
        port = self.plugin.metrics_port()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as err:
            return int(err.code)

    def close(self) -> None:
        if self.plugin is not None:
            self.plugin.cleanup()
        self.api.stop()


@pytest.fixture
def node(short_tmp: Path) -> Iterator[Node]:
    made = Node(short_tmp)
    try:
        yield made
    finally:
        made.close()


def test_registers_publishes_and_republishes_after_a_kubelet_restart(node: Node) -> None:
    plugin = node.start(ALL_DRA)
    registered = plugin.dra_kubelet.wait_registered(DRIVER, timeout=30)
    assert registered.service == "v1.DRAPlugin"
    (slc,) = wait_until(node.slices, "slices published")
    assert [d["name"] for d in slc["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert slc["spec"]["pool"]["name"] == NODE and slc["spec"]["nodeName"] == NODE
    assert slc["metadata"]["ownerReferences"][0]["uid"] == f"uid-node-{NODE}"
    assert slc["spec"]["devices"][0]["allowMultipleAllocations"] is True
    assert wait_until(lambda: node.readyz() == 200, "/readyz with DRA registered")
    first = node.generation()
    # A kubelet restart: registry emptied, the plugin's socket gone; the kubelet wipes the
    # node's slices at its start. The plugin re-creates its socket, is registered again, and
    # publishes anew at a higher generation.
    plugin.dra_kubelet.restart()
    assert node.api.dra.wipe_slices(NODE, DRIVER) == 1
    plugin.dra_kubelet.wait_registered(DRIVER, after=1, timeout=30)
    wait_until(lambda: node.generation() > first, "republished after re-registration")
    assert len(node.slices()) == 1
    assert node.log().count("registered with the kubelet; republishing") >= 2
    status = wait_until(lambda: node.status().get("registered") and node.status(), "status")
    assert status["served"] is True and status["slices"]["published"] is True
    # `inventory --state-dir` shows the running plugin's DRA state
    env = {"PATH": "/usr/bin:/bin", "NODE_NAME": NODE,
           "KUBECONFIG": str(node.root / "kubeconfig")}  # fmt: skip
    table = inventory(plugin, env, "--state-dir", str(plugin.state))
    assert "DRA (GPUs 0,1): registered=yes slices=1" in table
    assert "time-slicing (dra)" in table


def inventory(plugin: PluginProcess, env: dict[str, str], *args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "deviceplugin", "inventory", "--simulate", plugin.preset,
         "--config", str(plugin.config), *args],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_slices_wiped_while_registered_are_republished(node: Node) -> None:
    plugin = node.start(ALL_DRA)
    plugin.dra_kubelet.wait_registered(DRIVER, timeout=30)
    wait_until(node.slices, "slices published")
    first = node.generation()
    node.api.dra.wipe_slices(NODE, DRIVER)
    wait_until(node.slices, "slices republished after the wipe")
    assert node.generation() > first


def test_dropped_consumable_capacity_is_reported_and_fallen_back_from(node: Node) -> None:
    node.api.dra.drop_consumable = True
    plugin = node.start(ALL_DRA)
    plugin.dra_kubelet.wait_registered(DRIVER, timeout=30)
    events = wait_until(
        lambda: [e for e in node.api.events if e["reason"] == "DraFieldsDropped"], "Node Event"
    )
    assert events[0]["involvedObject"]["kind"] == "Node"
    assert "allowMultipleAllocations" in events[0]["message"]
    status = wait_until(
        lambda: node.status().get("slices", {}).get("published") and node.status(), "fallback"
    )
    assert status["slices"]["consumableCapacity"] is False
    assert any("requestPolicy" in p for p in status["slices"]["droppedFields"])
    (slc,) = node.slices()
    assert all("allowMultipleAllocations" not in d for d in slc["spec"]["devices"])
    assert "the API server dropped resourceslice fields" in node.log()


def dra_claim(name: str, device: str) -> dict[str, Any]:
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device,
              "consumedCapacity": {"memory": "4Gi"}, "shareID": "share-1"}  # fmt: skip
    request = {"name": "gpu", "exactly": {"deviceClassName": "time-slicing.gpu-fraction.dev",
                                          "capacity": {"requests": {"memory": "4Gi"}}}}  # fmt: skip
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "ns", "name": name},
        "spec": {"devices": {"requests": [request]}},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


def test_one_node_gpu0_device_plugin_gpu1_dra_never_both(node: Node) -> None:
    plugin = node.start(GPU1_ON_DRA)
    plugin.wait_registered(1)
    plugin.dra_kubelet.wait_registered(DRIVER, timeout=30)
    (slc,) = wait_until(node.slices, "slices published")
    assert [d["name"] for d in slc["spec"]["devices"]] == ["gpu-1"]
    (resource,) = plugin.kubelet.resources()
    gpus = {device_id.split("::")[0] for device_id, _, _ in plugin.kubelet.devices(resource)}
    gpu1_uuid = slc["spec"]["devices"][0]["attributes"]["uuid"]["string"]
    assert len(gpus) == 1 and gpu1_uuid not in gpus
    # the device-plugin side refuses GPU 1's slices
    with pytest.raises(Exception, match="unknown device IDs"):
        plugin.kubelet.allocate_ids(resource, [f"{gpu1_uuid}::0"])
    # the DRA side refuses GPU 0: a claim allocated gpu-0 in our pool gets an error
    claim = node.api.dra.add_claim(dra_claim("on-gpu0", "gpu-0"))
    uid = claim["metadata"]["uid"]
    answer = plugin.dra_kubelet.prepare(DRIVER, [("ns", "on-gpu0", uid)])
    assert answer[uid].error and not answer[uid].devices
    # and prepares GPU 1
    claim = node.api.dra.add_claim(dra_claim("on-gpu1", "gpu-1"))
    uid = claim["metadata"]["uid"]
    answer = plugin.dra_kubelet.prepare(DRIVER, [("ns", "on-gpu1", uid)])
    assert not answer[uid].error
    assert [d.device_name for d in answer[uid].devices] == ["gpu-1"]
    assert wait_until(lambda: node.readyz() == 200, "/readyz with both APIs registered")


def test_without_credentials_dra_gpus_are_not_served_and_say_why(node: Node) -> None:
    plugin = node.start(GPU1_ON_DRA, credentials=False)
    plugin.wait_registered(1)
    wait_until(lambda: "DRA GPUs not served" in node.log(), "the log says why")
    assert "no API credentials" in node.log()
    status = node.status()
    assert status == {"served": False, "reason": status["reason"], "gpus": [1]}
    assert not list(plugin.registry_dir.glob("*.sock"))
    assert node.readyz() == 200  # the device-plugin GPU is served; DRA cannot be
    # `inventory` says the same, from the config and the environment
    report = json.loads(inventory(plugin, {"PATH": "/usr/bin:/bin"}, "--json"))
    assert [g["api"] for g in report["gpus"]] == ["device-plugin", "dra"]
    assert report["dra"]["served"] is False
    assert "no node name" in report["dra"]["reason"]


def test_reload_moves_a_gpu_to_dra_and_republishes_a_plan_change(node: Node) -> None:
    plugin = node.start("version: v1\n")
    plugin.wait_registered(1)
    (resource,) = plugin.kubelet.resources()
    assert len({d.split("::")[0] for d, _, _ in plugin.kubelet.devices(resource)}) == 2
    assert plugin.proc is not None
    # SIGHUP with GPU 1 on DRA: the front-end starts, GPU 1 leaves the device-plugin list
    plugin.config.write_text(GPU1_ON_DRA)
    plugin.proc.send_signal(signal.SIGHUP)
    plugin.dra_kubelet.wait_registered(DRIVER, timeout=30)
    (slc,) = wait_until(node.slices, "slices published after the reload")
    gpu1 = slc["spec"]["devices"][0]["attributes"]["uuid"]["string"]

    def listed() -> set[str]:
        return {d.split("::")[0] for d, _, _ in plugin.kubelet.devices(resource)}

    assert plugin.kubelet.wait_for(lambda: bool(listed()) and gpu1 not in listed(), 20), (
        "GPU 1 still listed by the device-plugin API"
    )
    first = node.generation()
    # a plan change of a DRA GPU: republished at a higher generation
    plugin.config.write_text(
        GPU1_ON_DRA.replace("    mode: time-slicing\n    api", "    mode: sm-sharing\n    api")
    )
    plugin.proc.send_signal(signal.SIGHUP)
    (slc,) = wait_until(
        lambda: [s for s in node.slices() if s["spec"]["pool"]["generation"] > first], "republish"
    )
    assert slc["spec"]["devices"][0]["attributes"]["mode"] == {"string": "sm-sharing"}


def test_an_unusable_checkpoint_keeps_dra_off_and_the_node_not_ready(node: Node) -> None:
    from deviceplugin.dra.checkpoint import CHECKPOINT_FILE

    state = node.root / "state"
    state.mkdir(mode=0o700)
    (state / CHECKPOINT_FILE).write_text("{not json")
    plugin = node.start(GPU1_ON_DRA)
    plugin.wait_registered(1)
    wait_until(lambda: "DRA GPUs not served" in node.log(), "the log says why")
    assert node.status()["reason"].startswith("checkpoint unusable")
    assert not list(plugin.registry_dir.glob("*.sock"))
    assert node.readyz() == 503
    assert (state / CHECKPOINT_FILE).read_text() == "{not json"  # never overwritten
