"""The device-plugin API on a real node: the real scheduler places pods by the Node's
allocatable, the real kubelet calls Allocate and containerd with runc starts the container
from our CDI devices; the real API server runs the shipped admission policy."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from deviceplugin.mps import layout
from tests.cluster.agent import DP_GPUS, EX, MPS_ROOT, SM, TS, Agent, node_spec
from tests.cluster.conftest import pod
from tests.cluster.kube import Cluster, ClusterError, Obj, unschedulable, wait_for, wait_running
from tests.cluster.probe import SCRIPT, Seen
from tests.cluster.requirements import REPO
from tests.e2e.runtime import NVIDIA_MAJOR

pytestmark = pytest.mark.cluster

SLICE_MIB = 1024  # the config's default sliceSize
ALLOCATIONS = "gpu-fraction.dev/allocations"


def planned(cluster: Cluster, agent: Agent) -> dict[int, dict[str, Any]]:
    """Per GPU index, what the plugin's own `inventory` says it advertises."""
    out = subprocess.run(
        cluster.argv(
            "env", f"PYTHONPATH={REPO}", sys.executable, "-m", "deviceplugin", "inventory",
            "--simulate", str(agent.root / "node.yaml"), "--config", str(agent.config), "--json",
        ),
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return {g["index"]: g for g in json.loads(out.stdout)["gpus"]}


def test_allocatable_is_the_plan(cluster: Cluster, agent: Agent) -> None:
    plan = planned(cluster, agent)
    expected = {TS: 0, SM: 0, EX: 0}
    for index in DP_GPUS:
        expected[plan[index]["resource"]] += plan[index]["slices"]
    assert expected[TS] > 0 and expected[SM] > 0 and expected[EX] == 1
    alloc = cluster.allocatable()
    assert {r: int(alloc.get(r, "0")) for r in expected} == expected


def seen(cluster: Cluster, name: str) -> Seen:
    def complete() -> Seen | None:
        s = Seen(cluster.logs(name))
        return s if s.complete else None

    wait_running(cluster, name)
    return wait_for(complete, 30, f"pod {name}'s probe output")


@pytest.mark.parametrize(
    ("resource", "count", "gpu"),
    [(TS, 4, 0), (SM, 2, 1), (EX, 1, 2)],
    ids=["time-slicing", "sm-sharing", "exclusive"],
)
def test_pod_runs_with_what_design_promises(
    cluster: Cluster, agent: Agent, pods: Callable[[Obj], Obj], resource: str, count: int,
    gpu: int,
) -> None:  # fmt: skip
    name = f"dp-{resource.rsplit('.', 1)[-1].replace('/', '-')}-{count}"
    pods(pod(name, {resource: str(count)}, command=SCRIPT))
    s = seen(cluster, name)
    sim = node_spec().gpus[gpu]
    env = s.env
    # our CDI device and the toolkit's: the GPU's node and the control nodes, nothing else
    assert s.nodes == {
        f"/dev/nvidia{sim.minor}": (NVIDIA_MAJOR, sim.minor),
        "/dev/nvidiactl": (NVIDIA_MAJOR, 255),
        "/dev/nvidia-uvm": (510, 0),
        "/dev/nvidia-uvm-tools": (510, 1),
    }, s.log
    if resource == EX:
        assert not [k for k in env if k.startswith(("NVIDIA_GPU_MEMORY", "CUDA_MPS"))], env
    else:
        mib = str(count * SLICE_MIB)
        assert env["NVIDIA_GPU_MEMORY_REQUEST"] == mib and env["NVIDIA_GPU_MEMORY_LIMIT"] == mib
    if resource == SM:
        pipe = layout.pipe_dir(MPS_ROOT, sim.uuid)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={count * SLICE_MIB}M"
        assert {str(pipe), "/dev/shm"} <= s.mounts
        assert len(s.section("pipe")) > 2, "the daemon's pipe dir is empty in the container"
    else:
        assert not [k for k in env if k.startswith("CUDA_MPS")], env

    def recorded() -> Any:
        value = cluster.pod(name)["metadata"].get("annotations", {}).get(ALLOCATIONS)
        return json.loads(value) if value else None

    record = wait_for(recorded, 60, f"{name}'s allocation record")
    assert list(record) == ["app"], record
    entry = record["app"]
    assert entry["gpu"] == sim.uuid, entry
    if resource != EX:
        assert entry["requestMiB"] == entry["limitMiB"] == count * SLICE_MIB, entry


def test_cap_override_is_rejected_by_the_shipped_policy(cluster: Cluster, agent: Agent) -> None:
    bad = pod("dp-override", {TS: "1"}, env={"NVIDIA_GPU_MEMORY_LIMIT": "999999"})
    with pytest.raises(ClusterError) as refused:
        cluster.apply([{**bad, "metadata": {"name": "dp-override", "namespace": "default"}}])
    assert "NVIDIA_GPU_MEMORY_LIMIT" in str(refused.value) or "denied" in str(refused.value)
    assert cluster.kubectl("get", "pod", "dp-override", check=False).returncode != 0


def test_more_slices_than_a_gpu_has_stays_pending(
    cluster: Cluster, agent: Agent, pods: Callable[[Obj], Obj]
) -> None:
    total = int(cluster.allocatable()[TS])
    pods(pod("dp-too-big", {TS: str(total + 1)}))

    message = wait_for(lambda: unschedulable(cluster, "dp-too-big"), 60, "the scheduler's verdict")
    assert f"Insufficient {TS}" in message, message
    assert cluster.pod("dp-too-big")["status"]["phase"] == "Pending"
