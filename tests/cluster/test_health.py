"""Health on a real node: an Xid on a device-plugin GPU reaches the real kubelet's allocatable,
one on a DRA GPU taints its device for the real scheduler, and with `NoExecute` the real
device-taint eviction controller evicts the pods on it; a plugin restart evicts nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.cluster.agent import DRA_GPUS, TS, Agent, node_spec, wait_serving
from tests.cluster.conftest import pod
from tests.cluster.kube import Cluster, Obj, phase, unschedulable, wait_for, wait_running

pytestmark = pytest.mark.cluster

TAINT_KEY = "gpu-fraction.dev/unhealthy"
TS_DRA_GPU = DRA_GPUS[0]  # GPU 3: time-slicing on DRA


def device(cluster: Cluster, name: str) -> Obj:
    for s in cluster.get("resourceslices")["items"]:
        if s["spec"].get("nodeName") != cluster.node:
            continue
        for d in s["spec"].get("devices", []):
            if d["name"] == name:
                return d  # type: ignore[no-any-return]
    raise KeyError(name)


def taints(cluster: Cluster, index: int) -> list[Obj]:
    return list(device(cluster, f"gpu-{index}").get("taints", []))


def pinned_claim(name: str, index: int, memory: str = "2Gi") -> Obj:
    """A claim only GPU `index` can satisfy (a CEL selector on its published index)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "time-slicing.gpu-fraction.dev",
            "capacity": {"requests": {"memory": memory}},
            "selectors": [{"cel": {
                "expression": f'device.attributes["gpu-fraction.dev"].index == {index}'}}],
        }}]}},
    }  # fmt: skip


def claim_pod(name: str) -> Obj:
    return pod(name, claims=[{"name": "gpu", "resourceClaimName": name}], container_claims=["gpu"])


def test_xid_79_on_a_device_plugin_gpu_drops_the_nodes_allocatable(
    cluster: Cluster, agent: Agent
) -> None:
    slices = node_spec().gpus[0]  # GPU 0: the time-slicing GPU of the device-plugin API
    before = int(cluster.allocatable()[TS])
    assert before > 0
    agent.inject(slices.index, "--xid", "79")
    try:
        wait_for(lambda: int(cluster.allocatable()[TS]) == 0, 120,
                 f"{TS} allocatable 0 after Xid 79 on GPU {slices.index}")  # fmt: skip
    finally:
        agent.inject(slices.index, "--recover")
    wait_for(lambda: int(cluster.allocatable()[TS]) == before, 120, f"{TS} back to {before}")


def test_xid_79_on_a_dra_gpu_taints_it_for_the_real_scheduler(
    cluster: Cluster, agent: Agent, pods: Callable[[Obj], Obj]
) -> None:
    assert taints(cluster, TS_DRA_GPU) == []
    agent.inject(TS_DRA_GPU, "--xid", "79")
    try:
        (taint,) = wait_for(lambda: taints(cluster, TS_DRA_GPU), 60, f"gpu-{TS_DRA_GPU} tainted")
        assert taint["key"] == TAINT_KEY and taint["effect"] == "NoSchedule", taint
        pods(pinned_claim("pinned", TS_DRA_GPU))
        pods(claim_pod("pinned"))
        message = wait_for(lambda: unschedulable(cluster, "pinned"), 60, "the scheduler's verdict")
        assert "claim" in message.lower(), message
        assert phase(cluster, "pinned") == "Pending"
    finally:
        agent.inject(TS_DRA_GPU, "--recover")
    wait_for(lambda: taints(cluster, TS_DRA_GPU) == [], 60, f"gpu-{TS_DRA_GPU}'s taint removed")
    wait_running(cluster, "pinned")


def restart_with(agent: Agent, cluster: Cluster, effect: str) -> None:
    agent.terminate()
    agent.write_config(effect=effect)
    agent.start()
    wait_serving(cluster, agent)


def test_no_execute_evicts_the_pods_on_a_faulted_gpu_and_a_restart_evicts_none(
    cluster: Cluster, agent: Agent, pods: Callable[[Obj], Obj]
) -> None:
    restart_with(agent, cluster, "NoExecute")
    try:
        pods(pinned_claim("victim", TS_DRA_GPU))
        pods(claim_pod("victim"))
        wait_running(cluster, "victim")
        uid = cluster.pod("victim")["metadata"]["uid"]
        # a plugin restart (SIGTERM, start) taints nothing, so it evicts nothing
        agent.terminate()
        agent.start()
        wait_serving(cluster, agent)
        wait_for(lambda: agent_judged(cluster), 60, "every DRA device published")
        assert cluster.pod("victim")["metadata"]["uid"] == uid
        assert cluster.pod("victim")["status"]["phase"] == "Running"
        assert not cluster.pod("victim")["metadata"].get("deletionTimestamp")

        agent.inject(TS_DRA_GPU, "--xid", "79")
        try:
            wait_for(lambda: evicted(cluster, "victim"), 120, "the real controller's eviction")
        finally:
            agent.inject(TS_DRA_GPU, "--recover")
        wait_for(lambda: taints(cluster, TS_DRA_GPU) == [], 60, "the taint removed")
    finally:
        restart_with(agent, cluster, "NoSchedule")


def agent_judged(cluster: Cluster) -> bool:
    names = {f"gpu-{i}" for i in DRA_GPUS}
    published: dict[str, Any] = {}
    for s in cluster.get("resourceslices")["items"]:
        if s["spec"].get("nodeName") == cluster.node:
            published.update({d["name"]: d for d in s["spec"].get("devices", [])})
    return names <= set(published)


def evicted(cluster: Cluster, name: str) -> bool:
    out = cluster.kubectl("get", "pod", name, "-o", "json", check=False)
    if out.returncode != 0:
        return "NotFound" in out.stderr
    p = json.loads(out.stdout)
    conditions = p.get("status", {}).get("conditions", [])
    return bool(p["metadata"].get("deletionTimestamp")) or any(
        c["type"] == "DisruptionTarget" and c["status"] == "True" for c in conditions
    )
