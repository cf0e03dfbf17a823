"""The agent's token touches only its own node (issue 33 item 3): the real API server, with the
shipped RBAC and admission policies, refuses each write a stolen pod-bound token could try
outside its node and admits the one of each kind the agent makes.

Every request here carries the agent's own credentials (the token bound to its pod on this
node, `tests/cluster/agent.py`), never the admin's. A second Node object stands for another
node: nothing runs on it, it is unschedulable and tainted, and it goes at the end. A refusal
must come from the policy that owns it (its name is in the error), not from RBAC, so each test
fails where that policy is missing. Claims are the exception: from 1.36 the API server's own
granular status authorisation refuses a claim allocated to another node before admission
runs (`docs/rbac.md`), so the claim test accepts either refusal and says which it got.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from deviceplugin.dpapi import kube_records as rec
from tests.cluster.agent import Agent
from tests.cluster.conftest import pod
from tests.cluster.kube import Cluster, Obj, wait_for
from tests.cluster.requirements import REPO

pytestmark = pytest.mark.cluster

OTHER = "gf-confinement-other"
DRIVER = "gpu-fraction.dev"
RECORD = rec.ALLOCATIONS_KEY
POLICIES = (
    "gpu-fraction-pods", "gpu-fraction-nodes", "gpu-fraction-events",
    "gpu-fraction-resourceslices", "gpu-fraction-resourceclaim-status",
)  # fmt: skip


# One call of the agent's own API client (deviceplugin.kube.client.Api) with its kubeconfig,
# inside the cluster's namespaces; prints the HTTP status and the server's message.
_CALL = r"""
import json, sys
from deviceplugin.kube.client import KubeError, load_api
api = load_api({"KUBECONFIG": sys.argv[1]})
try:
    getattr(api, sys.argv[2])(*json.loads(sys.argv[3]), **json.loads(sys.argv[4]))
    print(json.dumps({"status": 200, "error": ""}))
except KubeError as err:
    print(json.dumps({"status": err.status, "error": str(err)}))
"""


@dataclass(frozen=True)
class Answer:
    status: int | None
    error: str


class AsAgent:
    """The agent's client with the agent's pod-bound token: the very calls the agent makes
    (`patch_pod`, `patch_node`, `create_event`, ...), never raising; the caller judges."""

    def __init__(self, cluster: Cluster, agent: Agent) -> None:
        self.cluster, self.kubeconfig = cluster, agent.kubeconfig

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Answer:
        out = subprocess.run(
            self.cluster.argv(
                "env", f"PYTHONPATH={REPO}", sys.executable, "-c", _CALL, str(self.kubeconfig),
                method, json.dumps(args), json.dumps(kwargs),
            ),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout.strip().splitlines()[-1])
        return Answer(answer["status"], answer["error"])


def refused_by(answer: Answer, policy: str) -> str:
    """The request was refused (403 or 422) by `policy`; returns the server's message."""
    assert answer.status in (403, 422), f"expected a refusal by {policy}: {answer}"
    assert f"ValidatingAdmissionPolicy '{policy}'" in answer.error, answer.error
    return answer.error


def admitted(answer: Answer) -> None:
    assert answer.status == 200, answer.error


@pytest.fixture(scope="module")
def other_node(cluster: Cluster) -> Iterator[str]:
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": OTHER, "labels": {"kubernetes.io/hostname": OTHER}},
        "spec": {
            "unschedulable": True,
            "taints": [{"key": "gpu-fraction.dev/confinement-test", "effect": "NoSchedule"}],
        },
    }
    cluster.apply([node])
    try:
        yield OTHER
    finally:
        cluster.delete("resourceslice", "-l", "gpu-fraction.dev/confinement-test")
        cluster.delete("node", OTHER)


@pytest.fixture
def as_agent(cluster: Cluster, agent: Agent) -> AsAgent:
    return AsAgent(cluster, agent)


def test_the_real_api_server_type_checks_every_policy(cluster: Cluster, agent: Agent) -> None:
    """Each policy compiles against the real schemas without a warning (a misspelt field
    would only show at request time, as a refusal under failurePolicy Fail)."""
    for name in POLICIES:

        def checked(name: str = name) -> Obj | None:
            policy: Obj = cluster.get("validatingadmissionpolicy", name)
            status = policy.get("status", {})
            done = status.get("observedGeneration") == policy["metadata"]["generation"]
            return status if done else None

        status = wait_for(checked, 30, f"type checking of {name}")
        assert not status.get("typeChecking", {}).get("expressionWarnings"), (name, status)
        binding = cluster.get("validatingadmissionpolicybinding", name)
        assert binding["spec"]["validationActions"] == ["Deny"], name


# --- pods ------------------------------------------------------------------------------------


def test_pods_only_its_nodes_and_only_the_record(
    cluster: Cluster, as_agent: AsAgent, other_node: str, pods: Callable[..., Obj]
) -> None:
    mine = pod("confine-mine", command="sleep 600")
    mine["spec"]["nodeName"] = cluster.node
    pods(mine)
    elsewhere = pod("confine-elsewhere")
    elsewhere["spec"]["nodeName"] = other_node
    pods(elsewhere)
    value = '{"app":{"gpu":"GPU-test"}}'
    record = {"metadata": {"annotations": {RECORD: value}}}

    # allowed: the allocation record on a pod of its node, as kube_integration writes it
    admitted(as_agent("patch_pod", "default", "confine-mine", record))
    assert cluster.pod("confine-mine")["metadata"]["annotations"][RECORD] == value
    # a pod bound to another node
    message = refused_by(
        as_agent("patch_pod", "default", "confine-elsewhere", record), "gpu-fraction-pods"
    )
    assert f"not one on node {other_node}" in message
    # the image, beside the record (the whole container, so only the image differs)
    (container,) = cluster.pod("confine-mine")["spec"]["containers"]
    evil = {**container, "image": "example.com/evil:1"}
    image = {"metadata": record["metadata"], "spec": {"containers": [evil]}}
    refused_by(as_agent("patch_pod", "default", "confine-mine", image), "gpu-fraction-pods")
    # another annotation, a label
    for patch in ({"metadata": {"annotations": {"example.com/x": "1"}}},
                  {"metadata": {"labels": {"app": "hijacked"}}}):  # fmt: skip
        refused_by(as_agent("patch_pod", "default", "confine-mine", patch), "gpu-fraction-pods")
    after = cluster.pod("confine-mine")
    assert after["spec"]["containers"][0]["image"] == container["image"]
    assert "example.com/x" not in after["metadata"]["annotations"]
    assert "app" not in after["metadata"].get("labels", {})


# --- nodes -----------------------------------------------------------------------------------


def test_nodes_only_itself_and_only_our_keys(
    cluster: Cluster, as_agent: AsAgent, other_node: str
) -> None:
    mine = cluster.node
    key = "gpu-fraction.dev/confinement-test"
    ours = {"metadata": {"labels": {key: "yes"}, "annotations": {key: "yes"}}}
    try:
        admitted(as_agent("patch_node", mine, ours))
        assert cluster.node_object()["metadata"]["labels"][key] == "yes"
    finally:
        gone = {"metadata": {"labels": {key: None}, "annotations": {key: None}}}
        admitted(as_agent("patch_node", mine, gone))
    # another node, even with our own keys
    message = refused_by(as_agent("patch_node", other_node, ours), "gpu-fraction-nodes")
    assert f"not {other_node}" in message
    # a label and an annotation outside gpu-fraction.dev/, a taint, unschedulable
    for patch in (
        {"metadata": {"labels": {"example.com/pool": "gpu"}}},
        {"metadata": {"annotations": {"example.com/owner": "me"}}},
        {"spec": {"taints": [{"key": "example.com/drain", "effect": "NoExecute"}]}},
        {"spec": {"unschedulable": True}},
    ):
        refused_by(as_agent("patch_node", mine, patch), "gpu-fraction-nodes")
    node = cluster.node_object()
    assert "example.com/pool" not in node["metadata"]["labels"]
    assert not node["spec"].get("unschedulable") and not node["spec"].get("taints")


# --- ResourceSlices --------------------------------------------------------------------------


def slice_body(name: str, node: str, driver: str = DRIVER) -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name, "labels": {"gpu-fraction.dev/confinement-test": "yes"}},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": f"{node}-confinement", "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }


def test_slices_only_its_nodes_and_our_drivers(
    cluster: Cluster, as_agent: AsAgent, other_node: str
) -> None:
    # allowed: a slice of its node and our driver, created and deleted (the running agent may
    # delete it first: a pool it does not plan is an extra)
    admitted(as_agent("create_resource_slice", slice_body("confine-own", cluster.node)))
    deleted = as_agent("delete_resource_slice", "confine-own")
    assert deleted.status in (200, 404), deleted.error
    # another node's, created by the agent or deleted by it
    slice_ = slice_body("confine-other-node", other_node)
    message = refused_by(as_agent("create_resource_slice", slice_), "gpu-fraction-resourceslices")
    assert f"node {other_node}" in message
    cluster.apply([slice_])
    refused_by(
        as_agent("delete_resource_slice", "confine-other-node"), "gpu-fraction-resourceslices"
    )
    assert cluster.get("resourceslice", "confine-other-node")["spec"]["nodeName"] == other_node
    # another driver's, on its own node
    foreign = slice_body("confine-other-driver", cluster.node, driver="other.example.com")
    message = refused_by(as_agent("create_resource_slice", foreign), "gpu-fraction-resourceslices")
    assert "other.example.com" in message


# --- ResourceClaim status --------------------------------------------------------------------


def allocated_claim(cluster: Cluster, name: str, node: str) -> None:
    """A claim the admin allocates to `node` as the scheduler writes it: one nodeSelector term,
    one matchFields `metadata.name In [node]`."""
    cluster.apply([{
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "time-slicing.gpu-fraction.dev"}}]}},
    }])  # fmt: skip
    allocation = {
        "devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-3"}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
    }  # fmt: skip
    status = json.dumps({"status": {"allocation": allocation}})
    cluster.kubectl("patch", "resourceclaim", name, "-n", "default", "--subresource=status",
                    "--type=merge", "-p", status)  # fmt: skip


def apply_status(as_agent: AsAgent, name: str, node: str) -> Answer:
    """The agent's record, applied as the status writer applies it (dra/status.py)."""
    ready = {"type": "Ready", "status": "True", "reason": "Prepared", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip
    entry = {"driver": DRIVER, "pool": node, "device": "gpu-3", "conditions": [ready]}
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "status": {"devices": [entry]}}  # fmt: skip
    return as_agent("apply_resource_claim_status", "default", name, body, field_manager=DRIVER)


def test_claim_status_only_where_allocated_to_its_node(
    cluster: Cluster, as_agent: AsAgent, other_node: str
) -> None:
    try:
        allocated_claim(cluster, "confine-mine", cluster.node)
        allocated_claim(cluster, "confine-elsewhere", other_node)
        admitted(apply_status(as_agent, "confine-mine", cluster.node))
        written = cluster.get("resourceclaim", "confine-mine", "-n", "default")
        assert [d["driver"] for d in written["status"]["devices"]] == [DRIVER]

        answer = apply_status(as_agent, "confine-elsewhere", other_node)
        assert answer.status in (403, 422), f"admitted on another node's claim: {answer}"
        by_policy = "ValidatingAdmissionPolicy 'gpu-fraction-resourceclaim-status'" in answer.error
        # 1.36+: the API server's own check (resourceclaims/driver, associated-node:patch)
        by_server = 'resource="resourceclaims/driver"' in answer.error
        assert by_policy or by_server, answer.error
        claim = cluster.get("resourceclaim", "confine-elsewhere", "-n", "default")
        assert not claim["status"].get("devices")
        terms = claim["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"]
        assert terms[0]["matchFields"][0]["values"] == [other_node]
    finally:
        cluster.delete("resourceclaim", "confine-mine", "confine-elsewhere", "-n", "default")


# --- Events ----------------------------------------------------------------------------------


def event(involved: Obj, host: str) -> Obj:
    """An Event as the agent builds it (kube_records.event_body)."""
    return rec.event_body(involved, "ConfinementTest", "confinement test", False, host)


def test_events_only_about_its_node_or_a_pod(
    cluster: Cluster, as_agent: AsAgent, other_node: str
) -> None:
    me = cluster.node
    node = {"kind": "Node", "name": me}
    # allowed: about its node (in `default`) and about a pod (in the pod's namespace)
    admitted(as_agent("create_event", "default", event(node, me)))
    a_pod = {"kind": "Pod", "name": "anyone", "namespace": "kube-system"}
    admitted(as_agent("create_event", "kube-system", event(a_pod, me)))
    # about another node
    other = event({"kind": "Node", "name": other_node}, me)
    refused_by(as_agent("create_event", "default", other), "gpu-fraction-events")
    # about something that is neither its node nor a pod
    secret = event({"kind": "Secret", "name": "x", "namespace": "kube-system"}, me)
    refused_by(as_agent("create_event", "kube-system", secret), "gpu-fraction-events")
    # posing as another node's agent
    posing = event(node, other_node)
    message = refused_by(as_agent("create_event", "default", posing), "gpu-fraction-events")
    assert "must name that node" in message
    sent = [(e["involvedObject"]["kind"], e["involvedObject"]["name"], e["reportingInstance"])
            for ns in ("default", "kube-system") for e in cluster.events(ns)
            if e.get("reason") == "ConfinementTest"]  # fmt: skip
    assert sorted(sent) == [("Node", me, me), ("Pod", "anyone", me)]
