"""NodePrepareResources and NodeUnprepareResources through the real plugin process, with the
package's DRA kubelet simulator and the in-test API server: each mode with and without a ceiling
in the claim config, idempotence, wrong UID, unallocated claims, another driver's results, the
over-capacity refusal, unprepare after the claim is deleted, and a plugin restart in between.
Every answer is resolved as a CDI runtime would, against the spec files the plugin and the
simulated toolkit wrote."""

from __future__ import annotations

import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.simulate.apiserver import FakeApiServer
from deviceplugin.simulate.dra_kubelet import KubeletError, resolve_cdi
from deviceplugin.simulate.rbac import Policy
from tests.plugin_proc import PluginProcess

NODE = "node-dra"
DRIVER = "gpu-fraction.dev"
CONFIG = """
version: v1
api: dra
ceilings: allow-overcommit
gpus:
  - {match: {index: 0}, mode: time-slicing}
  - {match: {index: 1}, mode: sm-sharing}
  - {match: {index: 2}, mode: exclusive}
"""

Ref = tuple[str, str, str]
# a claim as the API server would hold it (the client validates what it sends back)
CLASS = "time-slicing.gpu-fraction.dev"


class Node:
    def __init__(self, api: FakeApiServer, plugin: PluginProcess, kubeconfig: Path) -> None:
        self.api = api
        self.plugin = plugin
        self.kubeconfig = kubeconfig
        self.registrations = 0

    def start(self) -> None:
        self.plugin.start({"KUBECONFIG": str(self.kubeconfig), "NODE_NAME": NODE})
        try:
            self.plugin.dra_kubelet.wait_registered(DRIVER, self.registrations, timeout=60)
        except KubeletError:
            raise AssertionError(self.plugin.log.read_text()[-4000:]) from None
        self.registrations += 1

    def claim(
        self,
        name: str,
        *results: dict[str, Any],
        config: list[dict[str, Any]] | None = None,
        allocated: bool = True,
    ) -> Ref:
        obj: dict[str, Any] = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": "default", "name": name},
            "spec": {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]}
            },
            "status": {},
        }
        if allocated:
            obj["status"]["allocation"] = {
                "devices": {"results": list(results), "config": config or []},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [NODE]}
                            ]
                        }
                    ]
                },
            }
        stored = self.api.dra.add_claim(obj)
        return ("default", name, stored["metadata"]["uid"])

    def prepare(self, *refs: Ref, service: str | None = None) -> dict[str, Any]:
        return self.plugin.dra_kubelet.prepare(DRIVER, list(refs), service)

    def unprepare(self, *refs: Ref) -> dict[str, Any]:
        return self.plugin.dra_kubelet.unprepare(DRIVER, list(refs))

    def env(self, answer: Any) -> dict[str, str]:
        """The container env a runtime builds from the answer's CDI devices (later wins)."""
        assert answer.error == "", answer.error
        ids = [i for d in answer.devices for i in d.cdi_device_ids]
        edits = resolve_cdi(ids, [self.plugin.cdi])
        return dict(e.split("=", 1) for edit in edits for e in edit.get("env", []))

    def nodes(self, answer: Any) -> list[str]:
        ids = [i for d in answer.devices for i in d.cdi_device_ids]
        edits = resolve_cdi(ids, [self.plugin.cdi])
        return [n["path"] for edit in edits for n in edit.get("deviceNodes", [])]


def result(device: str, memory: str | None = None, share: str | None = None, **kw: Any) -> Any:
    r: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
    if memory is not None:
        r["consumedCapacity"] = {"memory": memory}
    if share is not None:
        r["shareID"] = share
    return {**r, **kw}


def ceiling(limit: str, **more: Any) -> dict[str, Any]:
    params = {"apiVersion": "gpu-fraction.dev/v1", "kind": "GpuShareConfig", "memoryLimit": limit}
    return {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {**params, **more}}}


@pytest.fixture
def node(short_tmp: Path) -> Iterator[Node]:
    api = FakeApiServer().start()
    api.add_node(NODE)
    plugin = PluginProcess(short_tmp, preset="h200x8", config=CONFIG)
    plugin.dra_kubelet.start()
    try:
        yield Node(api, plugin, api.write_kubeconfig(short_tmp / "kubeconfig"))
    finally:
        plugin.cleanup()
        api.stop()


def test_each_mode_with_and_without_a_ceiling(node: Node) -> None:
    node.start()
    plain = node.claim("ts", result("gpu-0", "4Gi", "s-ts"))
    capped = node.claim("ts-cap", result("gpu-0", "4Gi", "s-cap"), config=[ceiling("8Gi")])
    sm = node.claim("sm", result("gpu-1", "2Gi", "s-sm"))
    sm_cap = node.claim(
        "sm-cap",
        result("gpu-1", "2Gi", "s-smc"),
        config=[ceiling("6Gi", activeThreadPercentage=25)],
    )
    whole = node.claim("ex", result("gpu-2"))
    out = node.prepare(plain, capped, sm, sm_cap, whole)

    ts_env = node.env(out[plain[2]])
    assert ts_env["NVIDIA_GPU_MEMORY_REQUEST"] == ts_env["NVIDIA_GPU_MEMORY_LIMIT"] == "4096"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in ts_env
    assert node.env(out[capped[2]])["NVIDIA_GPU_MEMORY_LIMIT"] == "8192"
    (dev,) = out[plain[2]].devices
    assert (dev.pool_name, dev.device_name, list(dev.request_names)) == (NODE, "gpu-0", ["gpu"])
    assert dev.share_id == "s-ts"
    assert dev.cdi_device_ids[1] == f"gpu-fraction.dev/claim={plain[2]}-gpu-0-0"

    sm_env = node.env(out[sm[2]])
    assert sm_env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    sm_gpu = out[sm[2]].devices[0].cdi_device_ids[0].split("=", 1)[1]  # the driver's device
    # the daemon's own pipe path, mounted at that same path (DESIGN 3b)
    assert sm_env["CUDA_MPS_PIPE_DIRECTORY"] == str(node.plugin.mps_root / sm_gpu / "pipe")
    sm_cap_env = node.env(out[sm_cap[2]])
    assert sm_cap_env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M"
    assert sm_cap_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"

    (ex,) = out[whole[2]].devices
    assert not ex.HasField("share_id")
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in node.env(out[whole[2]])
    assert "/dev/nvidia2" in node.nodes(out[whole[2]])  # the toolkit's device for that GPU


def test_refusals_and_idempotence(node: Node) -> None:
    node.start()
    ok = node.claim("ok", result("gpu-0", "100Gi", "s-1"))
    first = node.prepare(ok)
    assert first[ok[2]].error == ""
    again = node.prepare(ok)
    assert again[ok[2]].devices == first[ok[2]].devices

    too_much = node.claim("more", result("gpu-0", "100Gi", "s-2"))
    replaced = ("default", "ok", "0b6a1f1e-0000-4000-8000-000000000000")
    unallocated = node.claim("pending", allocated=False)
    theirs = node.claim("theirs", result("gpu-0", "1Gi", driver="gpu.nvidia.com"))
    out = node.prepare(too_much, replaced, unallocated, theirs)
    assert "beyond its capacity" in out[too_much[2]].error
    assert "it was replaced" in out[replaced[2]].error
    assert out[unallocated[2]].error == "ResourceClaim default/pending is not allocated"
    assert "no device of driver gpu-fraction.dev" in out[theirs[2]].error
    assert all(not out[r[2]].devices for r in (too_much, replaced, unallocated, theirs))

    assert node.unprepare(ok)[ok[2]].error == ""
    assert node.prepare(too_much)[too_much[2]].error == ""  # the capacity came back


def test_plugin_restart_between_prepare_and_unprepare(node: Node) -> None:
    node.start()
    a = node.claim("a", result("gpu-1", "3Gi", "s-a"))
    b = node.claim("b", result("gpu-0", "1Gi", "s-b"))
    before = node.prepare(a, b)
    env_a = node.env(before[a[2]])
    assert node.plugin.terminate(signal.SIGTERM) == 0
    sockets = [node.plugin.plugins_dir / DRIVER / "dra.sock"]
    sockets.append(node.plugin.registry_dir / f"{DRIVER}-reg.sock")
    assert not [s for s in sockets if s.exists()], "sockets left behind on SIGTERM"

    node.api.dra.delete_claim("default", "a")
    node.start()
    after = node.prepare(a)  # answered from the checkpoint: the claim is gone
    assert after[a[2]].devices == before[a[2]].devices
    assert node.env(after[a[2]]) == env_a
    assert node.unprepare(a)[a[2]].error == ""
    with pytest.raises(KubeletError, match="unresolvable"):
        node.env(after[a[2]])
    assert node.env(before[b[2]])["NVIDIA_GPU_MEMORY_LIMIT"] == "1024"
    out = node.unprepare(a, b)  # a is unknown by now: success too
    assert [out[a[2]].error, out[b[2]].error] == ["", ""]
    with pytest.raises(KubeletError, match="unresolvable"):
        node.env(before[b[2]])


def claim_status(node: Node, ref: Ref) -> list[dict[str, Any]]:
    with node.api.cond:
        stored = node.api.dra.claims[(ref[0], ref[1])]
        return list((stored.get("status") or {}).get("devices") or [])


def wait_status(node: Node, ref: Ref, timeout: float = 15.0) -> list[dict[str, Any]]:
    assert node.api.wait_for(lambda _: bool(claim_status(node, ref)), timeout), (
        node.plugin.log.read_text()[-3000:]
    )
    return claim_status(node, ref)


def slice_attribute(node: Node, device: str, name: str) -> Any:
    (attr,) = [
        d["attributes"][name]
        for s in node.api.dra.slices_of(NODE)
        for d in s["spec"]["devices"]
        if d["name"] == device
    ]
    return next(iter(attr.values()))


def test_claim_status_carries_the_allocation_record(node: Node) -> None:
    node.start()
    node.api.wait_for(lambda _: bool(node.api.dra.slices_of(NODE)))
    capped = node.claim("ts-rec", result("gpu-0", "4Gi", "s-rec"), config=[ceiling("8Gi")])
    sm = node.claim("sm-rec", result("gpu-1", "2Gi", "s-smr"))
    whole = node.claim("ex-rec", result("gpu-2"))
    out = node.prepare(capped, sm, whole)

    (entry,) = wait_status(node, capped)
    assert (entry["driver"], entry["pool"], entry["device"], entry["shareID"]) == (
        DRIVER, NODE, "gpu-0", "s-rec",
    )  # fmt: skip
    (ready,) = entry["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared")
    data = entry["data"]
    env = node.env(out[capped[2]])
    assert data["gpu"] == slice_attribute(node, "gpu-0", "uuid")
    assert data["mode"] == "time-slicing"
    assert data["requestMiB"] == int(env["NVIDIA_GPU_MEMORY_REQUEST"]) == 4096
    assert data["limitMiB"] == int(env["NVIDIA_GPU_MEMORY_LIMIT"]) == 8192
    assert data["enforcement"] == slice_attribute(node, "gpu-0", "enforcement")
    assert "ts-rec" in data["ceiling"]["source"] and data["ceiling"]["outcome"] == "overcommit"
    assert "mpsPipe" not in data

    (sm_entry,) = wait_status(node, sm)
    sm_env = node.env(out[sm[2]])
    assert sm_entry["data"]["mode"] == "sm-sharing"
    assert sm_entry["data"]["mpsPipe"] == sm_env["CUDA_MPS_PIPE_DIRECTORY"]
    assert sm_entry["data"]["limitMiB"] == 2048 and sm_entry["data"]["ceiling"]["source"] is None

    (ex_entry,) = wait_status(node, whole)
    assert "shareID" not in ex_entry
    assert ex_entry["data"]["mode"] == "exclusive" and ex_entry["data"]["limitMiB"] is None
    # applied to the status subresource, never the claim itself, and never sending back the
    # scheduler's allocation (the ceiling's opaque parameters included: 1.37.2 refused that)
    applies = node.api.requests_for("PATCH", "/resourceclaims/")
    assert applies and all(r.path.endswith("/status") for r in applies)
    assert all(list(r.body["status"]) == ["devices"] for r in applies)
    assert not node.api.requests_for("PUT", "/resourceclaims/")


def test_a_failing_status_write_never_fails_the_prepare_and_is_retried(node: Node) -> None:
    node.start()
    node.api.fail_next[("PATCH", "namespaces")] = [500, 503, 409]
    ref = node.claim("retry", result("gpu-0", "1Gi", "s-r"))
    out = node.prepare(ref)
    assert out[ref[2]].error == ""
    (entry,) = wait_status(node, ref, timeout=20)
    assert entry["data"]["requestMiB"] == 1024
    assert node.plugin.log.read_text().count("claim status not written; retrying") == 3
    assert len(node.api.requests_for("PATCH", "/resourceclaims/")) == 4


def test_unprepare_removes_our_record_from_a_claim_that_stays(node: Node) -> None:
    """A claim that outlives its pod (a standalone ResourceClaim) loses our entry when it is
    unprepared; the record written with a ceiling's opaque config first (1.37.2 refused the
    old UPDATE of such a claim)."""
    node.start()
    node.api.wait_for(lambda _: bool(node.api.dra.slices_of(NODE)))
    ref = node.claim("kept", result("gpu-0", "4Gi", "s-k"), config=[ceiling("8Gi")])
    assert node.prepare(ref)[ref[2]].error == ""
    (entry,) = wait_status(node, ref)
    assert entry["data"]["limitMiB"] == 8192
    assert node.unprepare(ref)[ref[2]].error == ""
    assert node.api.wait_for(lambda _: not claim_status(node, ref), 15), (
        node.plugin.log.read_text()[-3000:]
    )
    assert "allocation" in node.api.dra.claims[("default", "kept")]["status"]


def test_the_api_server_refuses_status_for_a_device_not_allocated(node: Node) -> None:
    from deviceplugin.simulate.dra_apiserver import Invalid, validate_claim_status

    allocation = {"devices": {"results": [result("gpu-0", "1Gi", "s")]}}
    ok = {"driver": DRIVER, "pool": NODE, "device": "gpu-0", "shareID": "s"}
    validate_claim_status({"allocation": allocation}, {"allocation": allocation, "devices": [ok]})
    for bad in ({**ok, "device": "gpu-1"}, {**ok, "pool": "other-node"}, {**ok, "driver": "x"}):
        with pytest.raises(Invalid, match="allocated device"):
            validate_claim_status({"allocation": allocation},
                                  {"allocation": allocation, "devices": [bad]})  # fmt: skip
    with pytest.raises(Invalid, match="immutable"):
        validate_claim_status({"allocation": allocation}, {"allocation": {}, "devices": []})


def abandoned(node: Node, code: str) -> float:
    url = f"http://127.0.0.1:{node.plugin.metrics_port()}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpu_fraction_dra_claim_status_abandoned_total" and (
                sample.labels.get("code") == code
            ):
                return float(sample.value)
    return 0.0


@pytest.mark.parametrize(
    ("missing", "code", "refusal"),
    [
        # the status write itself: the authorizer's 403
        ("resourceclaims/status", "403",
         'cannot patch resource "resourceclaims/status" in API group "resource.k8s.io"'),
        # 1.36's node-scoped check inside the registry: a 422 with a Forbidden field error
        ("resourceclaims/driver", "422",
         'cannot associated-node:patch resource "resourceclaims/driver"'),
    ],
)  # fmt: skip
def test_a_status_write_the_rbac_refuses_is_told_once_and_counted(
    node: Node, missing: str, code: str, refusal: str
) -> None:
    """With one rule gone from the RBAC the stand-in enforces, the agent's status write is
    refused as the real API server refuses it; prepare still succeeds, the write is not
    retried, the metric counts it and one Node Event says which permission to check."""
    shipped = Policy.shipped()
    assert shipped is not None
    node.api.policy = shipped.without(missing)  # an older or trimmed manifest
    node.start()
    ref = node.claim("denied", result("gpu-0", "1Gi", "s-d"))
    assert node.prepare(ref)[ref[2]].error == ""
    assert node.api.wait_for(
        lambda api: any(e.get("reason") == "DraClaimStatusRefused" for e in api.events), 20
    ), node.plugin.log.read_text()[-3000:]
    (event,) = [e for e in node.api.events if e.get("reason") == "DraClaimStatusRefused"]
    assert f"status={code}" in event["message"] and refusal in event["message"]
    assert abandoned(node, code) == 1
    assert "claim status refused; not retried" in node.plugin.log.read_text()
    assert claim_status(node, ref) == []
    assert len(node.api.requests_for("PATCH", "/resourceclaims/denied/status")) == 1
    if code == "403":  # the authorizer's refusals are the ones `denied` keeps
        assert len(node.api.denied) == 1 and refusal in node.api.denied[0]
    node.api.denied.clear()
