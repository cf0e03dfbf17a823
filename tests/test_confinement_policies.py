"""The admission policies that hold the agent's token to its own node (issue 33 item 3), their
CEL run by a real CEL implementation as the API server runs it, on the bodies the agent's own
code writes (kube_records). The real API server's verdicts are in
tests/cluster/test_confinement.py. Also: the RBAC grants exactly the calls the code makes."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.dpapi import kube_records as rec
from deviceplugin.dra import slices
from deviceplugin.model import Mode
from deviceplugin.plan import SlicePlan
from tests.kustomize_render import DAEMONSET, Obj, find, one, overlay, render, render_files
from tests.planfixtures import gpu_plan
from tests.test_slice_policy import AGENT, AdmissionPolicy, agent_on

REPO = Path(__file__).resolve().parent.parent
KUBELET = {"username": "system:node:node-1", "groups": ["system:nodes"]}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    return render(overlay(tmp_path_factory.mktemp("dra"), "admission-policy", "dra"))


def policy(rendered: list[Obj], name: str) -> AdmissionPolicy:
    return AdmissionPolicy(one(rendered, "ValidatingAdmissionPolicy", name)["spec"])


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies the agent's merge patches."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


# --- pods ------------------------------------------------------------------------------------


def a_pod(node: str | None) -> Obj:
    spec: Obj = {"containers": [{"name": "app", "image": "busybox"}]}
    if node is not None:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "team", "labels": {"app": "x"},
                         "annotations": {"team.example.com/owner": "me"}},
            "spec": spec}  # fmt: skip


RECORD = {"metadata": {"annotations": {rec.ALLOCATIONS_KEY: '{"app":{"gpu":"GPU-1"}}'}}}


def test_the_agent_writes_the_record_on_its_nodes_pods_only(rendered: list[Obj]) -> None:
    pods = policy(rendered, "gpu-fraction-pods")
    old = a_pod("node-1")
    assert pods.admit("UPDATE", agent_on("node-1"), merge_patch(old, RECORD), old) is None
    # removing or rewriting the record is the agent's too (a repair)
    recorded = merge_patch(old, RECORD)
    assert pods.admit("UPDATE", agent_on("node-1"), old, recorded) is None
    denied = pods.admit("UPDATE", agent_on("node-2"), merge_patch(old, RECORD), old)
    assert denied is not None and "node-2" in denied and "node node-1" in denied
    pending = a_pod(None)
    denied = pods.admit("UPDATE", agent_on("node-1"), merge_patch(pending, RECORD), pending)
    assert denied is not None and "unscheduled" in denied


@pytest.mark.parametrize(
    "change",
    [
        {"spec": {"containers": [{"name": "app", "image": "example.com/evil"}]}},
        {"metadata": {"labels": {"app": "y"}}},
        {"metadata": {"labels": None}},
        {"metadata": {"annotations": {"team.example.com/owner": "them"}}},
        {"metadata": {"annotations": {"team.example.com/owner": None}}},
        {"metadata": {"annotations": {"gpu-fraction.dev/other": "1"}}},
        {"metadata": {"finalizers": ["example.com/hold"]}},
    ],
    ids=[
        "image",
        "label",
        "labels-removed",
        "annotation",
        "annotation-removed",
        "other-gpu-fraction-key",
        "finalizer",
    ],
)
def test_nothing_but_the_record_may_change_on_a_pod(rendered: list[Obj], change: Obj) -> None:
    pods = policy(rendered, "gpu-fraction-pods")
    old = a_pod("node-1")
    new = merge_patch(merge_patch(old, RECORD), change)
    denied = pods.admit("UPDATE", agent_on("node-1"), new, old)
    assert denied is not None


# --- nodes -----------------------------------------------------------------------------------


def a_node(name: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name,
                         "labels": {"kubernetes.io/hostname": name,
                                    "gpu-fraction.dev/mode.exclusive": "true"},
                         "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
            "spec": {"podCIDR": "10.0.0.0/24"}}  # fmt: skip


def agents_node_patch() -> Obj:
    """What the agent's node writer sends (kube_records.node_patch): labels set and removed
    (null), the plan annotation."""
    plan = SlicePlan(gpus=(gpu_plan(0, Mode.TIME_SLICING), gpu_plan(1, Mode.SM_SHARING)),
                     resources=())  # fmt: skip
    return rec.node_patch(plan, {}, set())


def test_the_agent_writes_its_own_nodes_labels_and_plan(rendered: list[Obj]) -> None:
    nodes = policy(rendered, "gpu-fraction-nodes")
    patch = agents_node_patch()
    assert rec.PLAN_KEY in patch["metadata"]["annotations"]
    old = a_node("node-1")
    new = merge_patch(old, patch)
    assert new != old
    assert nodes.admit("UPDATE", agent_on("node-1"), new, old) is None
    denied = nodes.admit("UPDATE", agent_on("node-1"), merge_patch(a_node("node-2"), patch),
                         a_node("node-2"))  # fmt: skip
    assert denied is not None and "not node-2" in denied


@pytest.mark.parametrize(
    "change",
    [
        {"spec": {"taints": [{"key": "x", "effect": "NoExecute"}]}},
        {"spec": {"unschedulable": True}},
        {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}},
        {"metadata": {"labels": {"kubernetes.io/hostname": None}}},
        {"metadata": {"annotations": {"example.com/owner": "me"}}},
        {"metadata": {"annotations": {"node.alpha.kubernetes.io/ttl": None}}},
        {"metadata": {"labels": {"x.gpu-fraction.dev/y": "1"}}},
    ],
    ids=[
        "taint",
        "unschedulable",
        "label",
        "label-removed",
        "annotation",
        "annotation-removed",
        "subdomain-label",
    ],
)
def test_only_gpu_fraction_keys_may_change_on_its_node(rendered: list[Obj], change: Obj) -> None:
    nodes = policy(rendered, "gpu-fraction-nodes")
    old = a_node("node-1")
    denied = nodes.admit("UPDATE", agent_on("node-1"), merge_patch(old, change), old)
    assert denied is not None


# --- events ----------------------------------------------------------------------------------


NODE = {"kind": "Node", "name": "node-1", "uid": "u"}
POD = {"kind": "Pod", "name": "p", "namespace": "team", "uid": "u"}


def create(rendered: list[Obj], body: Obj, user: Obj | None = None) -> str | None:
    events = policy(rendered, "gpu-fraction-events")
    return events.admit("CREATE", user or agent_on("node-1"), body, None,
                        namespace=body["metadata"]["namespace"])  # fmt: skip


def test_the_agents_own_events_are_admitted(rendered: list[Obj]) -> None:
    # exactly the bodies kube_integration sends: node events in `default`, pod events in the
    # pod's namespace
    assert create(rendered, rec.event_body(NODE, "GpuUnhealthy", "m", True, "node-1")) is None
    assert (
        create(rendered, rec.event_body(POD, "GpuAllocationRefused", "m", True, "node-1")) is None
    )
    own = rec.event_body({"kind": "Pod", "name": "agent", "namespace": "gpu-fraction-system"},
                         "Anything", "m", False, "node-1")  # fmt: skip
    assert create(rendered, own) is None


def test_events_elsewhere_or_from_another_node_are_refused(rendered: list[Obj]) -> None:
    other_node = rec.event_body({"kind": "Node", "name": "node-2"}, "GpuHealthy", "m", False,
                                "node-1")  # fmt: skip
    assert create(rendered, other_node) is not None
    moved = rec.event_body(POD, "GpuAllocationRefused", "m", True, "node-1")
    moved["metadata"]["namespace"] = "kube-system"
    assert create(rendered, moved) is not None
    secret = rec.event_body({"kind": "Secret", "name": "s", "namespace": "team"}, "R", "m",
                            False, "node-1")  # fmt: skip
    assert create(rendered, secret) is not None
    posing = rec.event_body(NODE, "GpuHealthy", "m", False, "node-2")
    denied = create(rendered, posing)
    assert denied is not None and "must name that node" in denied
    assert create(rendered, rec.event_body(NODE, "GpuHealthy", "m", False, "node-1"),
                  agent_on(None)) is not None  # fmt: skip


# --- ResourceClaim status --------------------------------------------------------------------


def a_claim(node: str | None, terms: list[Obj] | None = None) -> Obj:
    result = {"request": "gpu", "driver": slices.DRIVER, "pool": "node-1", "device": "gpu-0"}
    allocation: Obj = {"devices": {"results": [result]}}
    if node is not None:
        fields = [{"key": "metadata.name", "operator": "In", "values": [node]}]
        allocation["nodeSelector"] = {"nodeSelectorTerms": terms or [{"matchFields": fields}]}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "team"},
            "status": {"allocation": allocation,
                       "reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}}  # fmt: skip


def with_devices(claim: Obj, *drivers: str) -> Obj:
    out = copy.deepcopy(claim)
    out["status"]["devices"] = [
        {"driver": d, "pool": "node-1", "device": "gpu-0", "data": {"gpu": "GPU-1"}}
        for d in drivers
    ]
    return out


def status(rendered: list[Obj], new: Obj, old: Obj, node: str = "node-1") -> str | None:
    claims = policy(rendered, "gpu-fraction-resourceclaim-status")
    return claims.admit("UPDATE", agent_on(node), new, old, namespace="team")


def test_claim_status_on_claims_allocated_to_its_node(rendered: list[Obj]) -> None:
    mine = a_claim("node-1")
    assert status(rendered, with_devices(mine, slices.DRIVER), mine) is None
    # unprepare: the agent's entries removed
    assert status(rendered, mine, with_devices(mine, slices.DRIVER)) is None
    elsewhere = a_claim("node-2")
    denied = status(rendered, with_devices(elsewhere, slices.DRIVER), elsewhere)
    assert denied is not None and "allocated to node node-2" in denied


@pytest.mark.parametrize(
    "claim",
    [
        a_claim(None),
        a_claim("node-1", terms=[
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-2"]}]},
        ]),
        a_claim("node-1", terms=[{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["node-1", "node-2"]}]}]),
        a_claim("node-1", terms=[{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-1"]}]}]),
    ],
    ids=["no-node", "two-terms", "two-values", "label-selector"],
)  # fmt: skip
def test_a_claim_not_on_a_single_node_is_not_its_node(rendered: list[Obj], claim: Obj) -> None:
    """The node is read as the API server reads it (nodeNameFromAllocation): one term, one
    matchFields metadata.name In [one node]; anything else names no node."""
    denied = status(rendered, with_devices(claim, slices.DRIVER), claim)
    assert denied is not None and "no single node" in denied
    # nothing changed: nothing to judge
    assert status(rendered, claim, claim) is None


def test_claim_status_other_drivers_entries_and_the_binding_are_not_its(
    rendered: list[Obj],
) -> None:
    mine = a_claim("node-1")
    theirs = with_devices(mine, "other.example.com")
    denied = status(rendered, with_devices(mine, slices.DRIVER), theirs)
    assert denied is not None and "only gpu-fraction.dev's entries" in denied
    unreserved = copy.deepcopy(mine)
    del unreserved["status"]["reservedFor"]
    assert status(rendered, unreserved, mine) is not None
    moved = copy.deepcopy(mine)
    moved["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-1"
    assert status(rendered, moved, mine) is not None


# --- every policy: the agent's identity, Deny, and other writers left alone -----------------

AGENT_POLICIES = {
    "gpu-fraction-pods": (a_pod("node-1"), a_pod("node-2")),
    "gpu-fraction-nodes": (a_node("node-1"), a_node("node-2")),
    "gpu-fraction-resourceclaim-status": (a_claim("node-1"), a_claim("node-2")),
}


@pytest.mark.parametrize("name", sorted(AGENT_POLICIES))
def test_other_writers_and_a_nodeless_token(rendered: list[Obj], name: str) -> None:
    checked = policy(rendered, name)
    _, elsewhere = AGENT_POLICIES[name]
    changed = merge_patch(elsewhere, {"metadata": {"labels": {"anything": "1"}}})
    assert checked.admit("UPDATE", KUBELET, changed, elsewhere) is None
    denied = checked.admit("UPDATE", agent_on(None), changed, elsewhere)
    assert denied is not None and "names no node" in denied


def test_each_policy_matches_the_identity_rbac_binds_and_denies(rendered: list[Obj]) -> None:
    # a renamed service account or namespace would silently switch a policy off
    (account,) = find(rendered, "ServiceAccount")
    identity = (
        f"system:serviceaccount:{account['metadata']['namespace']}:{account['metadata']['name']}"
    )
    assert identity == AGENT
    ours = [p for p in find(rendered, "ValidatingAdmissionPolicy")
            if p["spec"].get("matchConditions")]  # fmt: skip
    names = {p["metadata"]["name"] for p in ours}
    assert names == {
        f"gpu-fraction-{s}"
        for s in ("pods", "nodes", "events", "resourceslices", "resourceclaim-status")
    }
    bindings = {
        b["spec"]["policyName"]: b for b in find(rendered, "ValidatingAdmissionPolicyBinding")
    }
    for p in ours:
        (condition,) = p["spec"]["matchConditions"]
        assert f'"{AGENT}"' in condition["expression"], p["metadata"]["name"]
        assert p["spec"]["failurePolicy"] == "Fail"
        assert p["metadata"]["name"] in bindings
        assert bindings[p["metadata"]["name"]]["spec"]["validationActions"] == ["Deny"]
        assert "matchResources" not in bindings[p["metadata"]["name"]]["spec"]  # every namespace
    events = one(rendered, "ValidatingAdmissionPolicy", "gpu-fraction-events")
    assert f"request.namespace == '{account['metadata']['namespace']}'" in str(events["spec"])


def test_the_base_confines_without_any_component(tmp_path: Path) -> None:
    names = {o["metadata"]["name"] for o in render(overlay(tmp_path))
             if o["kind"] == "ValidatingAdmissionPolicy"}  # fmt: skip
    assert {"gpu-fraction-pods", "gpu-fraction-nodes", "gpu-fraction-events"} <= names


# --- RBAC: exactly what the code calls ------------------------------------------------------

CORE_CALL = re.compile(
    r"self\._core\.(list|read|patch|create|replace|delete)_(?:namespaced_)?(pod|node|event)"
    r"(?:_for_all_namespaces)?\b"
)
VERBS = {"list": "list", "read": "get", "patch": "patch", "create": "create",
         "replace": "update", "delete": "delete"}  # fmt: skip


def test_the_base_role_grants_exactly_the_core_calls_the_code_makes() -> None:
    calls = set()
    for path in (REPO / "deviceplugin").rglob("*.py"):
        if "simulate" in path.parts:
            continue
        for m in CORE_CALL.finditer(path.read_text()):
            calls.add((m[2] + "s", VERBS[m[1]]))
            if m[1] == "list":
                calls.add((m[2] + "s", "watch"))  # the pod watch is a list with watch=True
    assert ("pods", "patch") in calls, "the scan finds the record writer"
    (role,) = [o for o in render_files(DAEMONSET / "base") if o["kind"] == "ClusterRole"]
    granted = {
        (res, v)
        for r in role["rules"]
        for g in r["apiGroups"]
        for res in r["resources"]
        for v in r["verbs"]
        if g == ""
    }
    assert all(r["apiGroups"] == [""] for r in role["rules"]), "core API only"
    assert granted == calls
