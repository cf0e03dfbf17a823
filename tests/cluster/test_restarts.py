"""Restarts on a real node: the plugin's (SIGTERM, and SIGKILL of its process group) adopt the
MPS daemons, leave running pods untouched and never wipe the node's ResourceSlices; the
kubelet's re-registers the plugin, leaves running pods untouched and admits new ones; after
a reboot of the node (`hack/cluster/reboot.sh`) every workload runs again (a bare DRA pod as
itself, device-plugin workloads as themselves or their replacements) and finds its CDI
devices and MPS server in the tmpfs paths the reboot emptied."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.ledger.record import read_records
from deviceplugin.mps import layout
from tests.cluster.agent import DP_GPUS, DRA_GPUS, MPS_ROOT, SM, TS, Agent, node_spec, wait_serving
from tests.cluster.conftest import pod
from tests.cluster.kube import (
    Cluster,
    ClusterError,
    Obj,
    restart_kubelet,
    wait_for,
    wait_running,
)
from tests.cluster.probe import SCRIPT, Seen
from tests.cluster.requirements import CLUSTER

pytestmark = pytest.mark.cluster

SM_DP_GPU, SM_DRA_GPU = DP_GPUS[1], DRA_GPUS[1]


def daemon_pids(cluster: Cluster) -> dict[int, str]:
    """Each sm-sharing GPU's MPS control daemon pid, from its pid file on the node."""
    out = {}
    for index in (SM_DP_GPU, SM_DRA_GPU):
        uuid = node_spec().gpus[index].uuid
        out[index] = cluster.sh(f"cat {layout.pid_file(MPS_ROOT, uuid)}").split()[0]
    return out


def containers(cluster: Cluster, names: list[str]) -> dict[str, tuple[str, str, int]]:
    """Per pod: its uid, its container's id and restart count."""
    out = {}
    for name in names:
        p = cluster.pod(name)
        (status,) = p["status"]["containerStatuses"]
        out[name] = (p["metadata"]["uid"], status["containerID"], status["restartCount"])
    return out


@contextmanager
def slices_watched(cluster: Cluster) -> Iterator[list[float]]:
    """Polls the node's ResourceSlices in the background; yields the times none was there."""
    empty: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            items = cluster.get("resourceslices")["items"]
            if not [s for s in items if s["spec"].get("nodeName") == cluster.node]:
                empty.append(time.monotonic())
            stop.wait(0.2)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield empty
    finally:
        stop.set()
        thread.join(10)


@pytest.fixture
def workload(cluster: Cluster, agent: Agent, pods: Callable[[Obj], Obj]) -> list[str]:
    """A running pod on each API: one on the sm-sharing GPU of each, one time-slicing."""
    pods(pod("rs-dp-sm", {SM: "2"}))
    pods(pod("rs-dp-ts", {TS: "1"}))
    pods({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "rs-dra-sm", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "sm-sharing.gpu-fraction.dev",
            "capacity": {"requests": {"memory": "2Gi"}},
        }}]}},
    })  # fmt: skip
    pods(pod("rs-dra-sm", claims=[{"name": "gpu", "resourceClaimName": "rs-dra-sm"}],
             container_claims=["gpu"]))  # fmt: skip
    names = ["rs-dp-sm", "rs-dp-ts", "rs-dra-sm"]
    for name in names:
        wait_running(cluster, name)
    return names


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL of the process group"])
def test_plugin_restart_adopts_daemons_and_touches_nothing(
    cluster: Cluster, agent: Agent, workload: list[str], how: str
) -> None:
    pids = daemon_pids(cluster)
    before = containers(cluster, workload)
    with slices_watched(cluster) as empty:
        if how == "SIGTERM":
            assert agent.terminate(signal.SIGTERM) == 0, agent.tail()
        else:
            agent.kill_group()
        agent.start()
        wait_serving(cluster, agent)
        time.sleep(3)  # a wipe right after serving would show in the watch
    assert empty == [], f"the node's ResourceSlices were gone {len(empty)} times"
    assert daemon_pids(cluster) == pids, "the MPS daemons were not adopted"
    assert containers(cluster, workload) == before
    assert "adopted" in agent.tail(20000), agent.tail()


def test_kubelet_restart_reregisters_and_admits(
    cluster: Cluster, agent: Agent, workload: list[str], pods: Callable[[Obj], Obj]
) -> None:
    before = containers(cluster, workload)
    alloc = dict(cluster.allocatable())
    restart_kubelet(cluster)
    wait_for(
        lambda: all(cluster.allocatable().get(r) == alloc[r] for r in (TS, SM)),
        90, "the plugin re-registered with the new kubelet",
    )  # fmt: skip
    wait_for(lambda: "registered" in agent.tail(3000), 30, "registration logged")
    pods(pod("rs-after", {TS: "2"}))
    wait_running(cluster, "rs-after")
    assert containers(cluster, workload) == before


def restarting(obj: Obj) -> Obj:
    """`obj` (a pod) with restartPolicy Always, as a workload that survives a reboot has."""
    obj["spec"]["restartPolicy"] = "Always"
    return obj


def replica_set(name: str, template: Obj) -> Obj:
    """One replica of pod `template` under a ReplicaSet: how device-plugin workloads survive
    a reboot on a real node (below)."""
    labels = {"reboot-workload": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": template["spec"]}},
    }  # fmt: skip


def replica(cluster: Cluster, workload: str) -> str | None:
    """The name of `workload`'s pod that is not finished (Failed, Succeeded), if one is."""
    items = cluster.get("pods", "-l", f"reboot-workload={workload}")["items"]
    live = [p for p in items if p.get("status", {}).get("phase") not in ("Failed", "Succeeded")]
    return live[0]["metadata"]["name"] if live else None


def probe_of(cluster: Cluster, name: str, not_container: str = "") -> tuple[str, Seen]:
    """The pod's Running container (other than `not_container`) and what its probe saw;
    raises ClusterError saying what it saw while there is none yet."""
    p = cluster.pod(name)
    statuses = p.get("status", {}).get("containerStatuses") or [{}]
    cid = statuses[0].get("containerID", "")
    if not cid or cid == not_container or "running" not in statuses[0].get("state", {}):
        raise ClusterError(f"{name}: phase {p.get('status', {}).get('phase')}, {statuses[0]}")
    logs = cluster.logs(name)
    seen = Seen(logs)
    if not seen.complete:
        raise ClusterError(f"{name}: {cid} running, its probe incomplete: {logs[-1500:]!r}")
    return cid, seen


def probed(cluster: Cluster, name: str) -> tuple[str, Seen]:
    return wait_for(lambda: probe_of(cluster, name), 240, f"pod {name} running its probe")


def rerun(cluster: Cluster, workload: str | None, old_name: str, old_cid: str) -> tuple[str, Seen]:
    """After the reboot: the pod `old_name` running a new container, or, when the kubelet
    rejected it at re-admission (a device-plugin `workload`'s pod), its replacement. Until
    the kubelet has judged the old pod its status still reads as before the reboot, so the
    pod to follow is known only once it runs again or is finished."""
    phase = cluster.pod(old_name).get("status", {}).get("phase")
    if workload is None or phase not in ("Failed", "Succeeded"):
        return old_name, probe_of(cluster, old_name, not_container=old_cid)[1]
    name = replica(cluster, workload)
    if name is None:
        raise ClusterError(f"{old_name} {phase}, no replacement yet")
    return name, probe_of(cluster, name)[1]


def own_specs(cluster: Cluster, agent: Agent, pods: list[str]) -> set[str]:
    """The CDI specs pods `pods` use: their device-plugin allocations' (whose owner the
    ledger learned from pod-resources) and their claims'. Not the directory's whole listing:
    another test's claim is unprepared, and its allocations removed, on their own time."""
    allocated = {
        Path(r.cdi_spec).name
        for r in read_records(agent.state)
        if r.owner is not None and r.owner[1] in pods and r.cdi_spec
    }
    return allocated | cluster.claim_specs(pods)


def caps(seen: Seen) -> dict[str, str]:
    return {k: v for k, v in seen.env.items() if k.startswith(("NVIDIA_", "CUDA_"))}


def test_node_reboot_restarts_every_pod_with_its_cdi_devices(
    cluster: Cluster, agent: Agent, pods: Callable[[Obj], Obj]
) -> None:
    """After a reboot the real kubelet admits the node's pods again as soon as it runs, in
    no order, often before the device plugin (a DaemonSet pod itself on a real node) has
    registered: it then rejects a pod with device-plugin resources for good
    (UnexpectedAdmissionError, "no healthy devices present": allocation_manager.go; upstream
    kubernetes#125579, #128043) and only a controller replaces it. So the device-plugin
    workloads run under ReplicaSets, and each must run again, as the same pod or as its
    replacement, with its caps and devices; a DRA pod's prepare the kubelet retries, so the
    bare DRA pod itself must start again, with the same devices and caps as before."""
    pods(replica_set("rb-dp-sm", restarting(pod("rb-dp-sm", {SM: "2"}, command=SCRIPT))))
    pods(replica_set("rb-dp-ts", restarting(pod("rb-dp-ts", {TS: "1"}, command=SCRIPT))))
    pods({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "rb-dra-sm", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "sm-sharing.gpu-fraction.dev",
            "capacity": {"requests": {"memory": "2Gi"}},
        }}]}},
    })  # fmt: skip
    pods(restarting(pod("rb-dra-sm", claims=[{"name": "gpu", "resourceClaimName": "rb-dra-sm"}],
                        container_claims=["gpu"], command=SCRIPT)))  # fmt: skip
    workloads = ["rb-dp-sm", "rb-dp-ts"]
    names = {w: wait_for(lambda w=w: replica(cluster, w), 60, f"{w}'s pod") for w in workloads}
    names["rb-dra-sm"] = "rb-dra-sm"
    before = {w: probed(cluster, name) for w, name in names.items()}

    # two allocations' specs (once pod-resources has shown the ledger their pods) and a claim's
    def known() -> set[str] | None:
        specs = own_specs(cluster, agent, list(names.values()))
        return specs if len(specs) == 3 else None

    specs_before = wait_for(known, 60, "the ledger to know the pods' allocations")
    claim_specs = {f for f in specs_before if f.startswith(cdi_specs.CLAIM_SPEC_PREFIX)}
    assert len(claim_specs) == 1, specs_before
    assert cluster.cdi_files() >= specs_before, "a spec our pods use is missing"

    out = subprocess.run([str(CLUSTER / "reboot.sh")], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert agent.proc is not None
    agent.proc.wait(10)  # the reboot killed it, as it kills a DaemonSet's pod
    agent.proc = None
    # what a reboot empties is empty: the pods cannot start from anything left over
    assert not cluster.cdi_files() & specs_before
    assert cluster.sh("test -e /run/gpu-fraction && echo left || true").strip() == ""

    agent.start()  # the DaemonSet's pod, started again by the kubelet on a real node
    wait_serving(cluster, agent)
    replaced = False
    for workload, old_name in names.items():
        old_cid, old = before[workload]
        name, seen = wait_for(
            lambda w=workload, n=old_name, c=old_cid: rerun(
                cluster, w if w in workloads else None, n, c
            ),
            240,
            f"{workload} running again",
        )
        if name == old_name:
            # the same pod: the same devices, caps and MPS wiring, from the same answers
            assert seen.nodes == old.nodes, (name, seen.log)
            assert caps(seen) == caps(old), (name, seen.log)
        else:
            # rejected at re-admission before the plugin registered, as upstream does
            status = cluster.pod(old_name)["status"]
            assert status.get("reason") == "UnexpectedAdmissionError", (old_name, status)
            assert caps(seen).keys() == caps(old).keys(), (name, seen.log)
            assert len(seen.nodes) == len(old.nodes), (name, seen.log)
        if "sm" in workload:
            assert len(seen.section("pipe")) > 2, f"{name}: the MPS pipe dir is empty"
        replaced |= name != old_name
        how = "the same pod" if name == old_name else f"{name}, its replacement"
        print(f"after the reboot: {workload} runs as {how}", flush=True)
    # every spec comes back for the same pods; a replacement's allocation has a spec of its own
    assert cluster.cdi_files() >= (claim_specs if replaced else specs_before), "not rewritten"
