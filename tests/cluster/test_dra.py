"""DRA on a real node: the real scheduler allocates from the plugin's ResourceSlices with
consumable capacity, the real kubelet prepares, containerd starts the container from the
claim's CDI devices, and the real API server accepts the claim's status under the shipped
RBAC. The shipped DeviceClasses and examples are applied unchanged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.cdi import specs as cdi_specs
from tests.cluster.agent import Agent
from tests.cluster.conftest import examples, pod
from tests.cluster.kube import Cluster, Obj, phase, wait_for, wait_running
from tests.cluster.requirements import REPO

pytestmark = pytest.mark.cluster

DRIVER = "gpu-fraction.dev"
TS_CLASS = "time-slicing.gpu-fraction.dev"
EXAMPLES = sorted(p for p in (REPO / "daemonset" / "examples" / "dra").glob("*.yaml")
                  if p.name != "kustomization.yaml")  # fmt: skip


def exec_env(cluster: Cluster, name: str) -> dict[str, str]:
    out = cluster.kubectl("exec", name, "--", "env").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def results(claim: Obj) -> list[Obj]:
    return list(claim["status"]["allocation"]["devices"]["results"])


def assert_prepared(cluster: Cluster, claim: Obj) -> None:
    """Allocated by the real scheduler from our slices, prepared, status written by us."""
    ours = [r for r in results(claim) if r["driver"] == DRIVER]
    assert ours, claim["status"]
    devices = claim["status"].get("devices", [])
    assert {(d["driver"], d["pool"], d["device"]) for d in devices} >= {
        (r["driver"], r["pool"], r["device"]) for r in ours
    }, devices
    for d in devices:
        ready = [c for c in d.get("conditions", []) if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", d
        assert d.get("data", {}).get("gpu"), d
    assert f"{cdi_specs.CLAIM_SPEC_PREFIX}{claim['metadata']['uid']}.json" in cluster.cdi_files()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: Path(p).stem)
def test_shipped_example_runs(cluster: Cluster, agent: Agent, example: Path) -> None:
    objects = examples(example)
    (workload,) = [o for o in objects if o["kind"] == "Pod"]
    name = workload["metadata"]["name"]
    command = workload["spec"]["containers"][0]["command"]
    cluster.kubectl("apply", "-f", str(example))
    try:
        if command[0] == "nvidia-smi":  # runs to completion: the GPU it saw is in its log
            done = wait_for(
                lambda: phase(cluster, name) in ("Succeeded", "Failed") and phase(cluster, name),
                120, f"example {name} done",
            )  # fmt: skip
            log = cluster.logs(name)
            described = cluster.kubectl("describe", "pod", name, check=False).stdout[-3000:]
            assert done == "Succeeded", f"{name} {done}: {log}\n{described}"
            gpus = [line for line in log.splitlines() if line.startswith("GPU ")]
            assert len(gpus) == 1, log
            # its claim, made from the template, goes with the finished pod: the agent's log
            # shows it prepared and unprepared
            ours = f"claim=default/{name}-"
            wait_for(lambda: f"msg=unprepared {ours}" in agent.since_start(), 60, "unprepare")
            assert f"msg=prepared {ours}" in agent.since_start()
            return
        wait_running(cluster, name)
        claims = cluster.claims_of(name)
        assert claims
        for claim in claims:
            assert_prepared(cluster, claim)
        classes = {
            r["exactly"]["deviceClassName"]
            for c in claims for r in c["spec"]["devices"]["requests"] if "exactly" in r
        }  # fmt: skip
        env = exec_env(cluster, name)
        if classes != {"exclusive.gpu-fraction.dev"}:
            assert "NVIDIA_GPU_MEMORY_LIMIT" in env, env
        if "sm-sharing.gpu-fraction.dev" in classes:
            assert env["CUDA_MPS_PIPE_DIRECTORY"].startswith("/run/gpu-fraction/mps/"), env
        uids = [c["metadata"]["uid"] for c in claims]
    finally:
        cluster.kubectl("delete", "-f", str(example), "--ignore-not-found", "--wait=true",
                        "--grace-period=0", "--force", timeout=120)  # fmt: skip
    # unprepared: every claim's CDI spec is gone once the pod is
    wait_for(
        lambda: not {f"{cdi_specs.CLAIM_SPEC_PREFIX}{u}.json" for u in uids} & cluster.cdi_files(),
        60, "the claims' CDI specs removed",
    )  # fmt: skip


def ts_template(name: str, memory: str) -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": TS_CLASS,
                                        "capacity": {"requests": {"memory": memory}}}},
        ]}}},
    }  # fmt: skip


def test_two_claims_share_one_gpu(
    cluster: Cluster, agent: Agent, pods: Callable[[Obj], Obj]
) -> None:
    pods(ts_template("share-3gi", "3Gi"))
    for n in ("share-a", "share-b"):
        pods(pod(n, claims=[{"name": "gpu", "resourceClaimTemplateName": "share-3gi"}],
                 container_claims=["gpu"]))  # fmt: skip
    for n in ("share-a", "share-b"):
        wait_running(cluster, n)
    (a,), (b,) = (results(c) for n in ("share-a", "share-b") for c in cluster.claims_of(n))
    assert (a["pool"], a["device"]) == (b["pool"], b["device"]), (a, b)
    assert a.get("shareID") and b.get("shareID") and a["shareID"] != b["shareID"], (a, b)
    assert a.get("consumedCapacity", {}).get("memory") == "3Gi", a
    for n in ("share-a", "share-b"):
        assert exec_env(cluster, n)["NVIDIA_GPU_MEMORY_LIMIT"] == str(3 * 1024)


def test_first_available_request_named_by_its_container(
    cluster: Cluster, agent: Agent, pods: Callable[[Obj], Obj]
) -> None:
    """The container names its request; the result names `request/subrequest`. The real
    kubelet hands the container the CDI IDs of the request it names, so the plugin must
    answer under the base request's name."""
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "first-available", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": [
            {"name": "huge", "deviceClassName": TS_CLASS,
             "capacity": {"requests": {"memory": "900Gi"}}},
            {"name": "small", "deviceClassName": TS_CLASS,
             "capacity": {"requests": {"memory": "2Gi"}}},
        ]}]}},
    }  # fmt: skip
    pods(claim)
    workload = pod(
        "first-available", claims=[{"name": "gpu", "resourceClaimName": "first-available"}]
    )
    workload["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu", "request": "gpu"}]}
    pods(workload)
    wait_running(cluster, "first-available")
    (result,) = results(cluster.get("resourceclaim", "first-available"))
    assert result["request"] == "gpu/small", result
    assert exec_env(cluster, "first-available")["NVIDIA_GPU_MEMORY_LIMIT"] == str(2 * 1024)
