"""The ResourceSlice admission policy of the DRA component (issue 30, item 10), its CEL run by
a real CEL implementation (cel-python) as the API server runs it: match conditions, then
variables, then validations. The agent's identity writes only slices of the node its token
names; other writers are not judged; a token without a node is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import pytest
from celpy import celtypes

from deviceplugin.dra import slices
from tests.kustomize_render import Obj, find, one, overlay, render

AGENT = "system:serviceaccount:gpu-fraction-system:gpu-fraction-plugin"
NODE_KEY = "authentication.kubernetes.io/node-name"


class AdmissionPolicy:
    def __init__(self, spec: Obj) -> None:
        env = celpy.Environment()

        def compile_(text: str) -> Any:
            return env.program(env.compile(text))

        self.conditions = [compile_(c["expression"]) for c in spec.get("matchConditions", [])]
        self.variables = [(v["name"], compile_(v["expression"])) for v in spec["variables"]]
        self.validations = [
            (compile_(v["expression"]), compile_(v["messageExpression"])
             if "messageExpression" in v else None, v.get("message", ""))
            for v in spec["validations"]
        ]  # fmt: skip

    def admit(
        self, operation: str, user: Obj, obj: Obj | None, old: Obj | None, namespace: str = ""
    ) -> str | None:
        """None when admitted, else the denial's message."""
        request = {"operation": operation, "userInfo": user, "namespace": namespace}
        activation: dict[str, Any] = {
            "request": celpy.json_to_cel(request),
            "object": celpy.json_to_cel(obj),
            "oldObject": celpy.json_to_cel(old),
        }
        if not all(bool(c.evaluate(activation)) for c in self.conditions):
            return None
        variables = celtypes.MapType({})
        activation["variables"] = variables
        for name, program in self.variables:
            variables[celtypes.StringType(name)] = program.evaluate(activation)
        for check, message, fixed in self.validations:
            ok = check.evaluate(activation)
            assert isinstance(ok, celtypes.BoolType), f"validation evaluated to {ok!r}"
            if not ok:
                return str(message.evaluate(activation)) if message is not None else fixed
        return None


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    return render(overlay(tmp_path_factory.mktemp("dra"), "dra"))


@pytest.fixture(scope="module")
def policy(rendered: list[Obj]) -> AdmissionPolicy:
    return AdmissionPolicy(
        one(rendered, "ValidatingAdmissionPolicy", "gpu-fraction-resourceslices")["spec"]
    )


def slice_of(node: str | None) -> Obj:
    pool = {"name": node or "all", "generation": 1, "resourceSliceCount": 1}
    spec: Obj = {"driver": slices.DRIVER, "pool": pool, "devices": []}
    if node is not None:
        spec["nodeName"] = node
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{slices.DRIVER}-0"}, "spec": spec}  # fmt: skip


def agent_on(node: str | None) -> Obj:
    user: Obj = {"username": AGENT, "groups": ["system:serviceaccounts"]}
    if node is not None:
        user["extra"] = {NODE_KEY: [node]}
    return user


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
def test_the_agent_writes_its_own_nodes_slices_only(
    policy: AdmissionPolicy, operation: str
) -> None:
    own = slice_of("node-1")
    assert policy.admit(operation, agent_on("node-1"), own, own) is None
    denied = policy.admit(operation, agent_on("node-1"), slice_of("node-2"), slice_of("node-2"))
    assert denied is not None and "node-1" in denied and "node node-2" in denied
    assert policy.admit(operation, agent_on("node-1"), slice_of(None), None) is not None


def test_a_delete_is_judged_by_the_slice_it_removes(policy: AdmissionPolicy) -> None:
    assert policy.admit("DELETE", agent_on("node-1"), None, slice_of("node-1")) is None
    assert policy.admit("DELETE", agent_on("node-1"), None, slice_of("node-2")) is not None


def test_a_token_without_a_node_is_refused(policy: AdmissionPolicy) -> None:
    denied = policy.admit("CREATE", agent_on(None), slice_of("node-1"), None)
    assert denied is not None and "ServiceAccountTokenPodNodeInfo" in denied


def test_another_drivers_slices_are_refused_even_on_its_own_node(policy: AdmissionPolicy) -> None:
    foreign = slice_of("node-1")
    foreign["spec"]["driver"] = "other.example.com"
    for operation, obj, old in (("CREATE", foreign, None), ("UPDATE", foreign, foreign),
                                ("DELETE", None, foreign)):  # fmt: skip
        denied = policy.admit(operation, agent_on("node-1"), obj, old)
        assert denied is not None and "other.example.com" in denied, operation


def test_other_writers_are_not_judged(policy: AdmissionPolicy) -> None:
    kubelet = {"username": "system:node:node-1", "groups": ["system:nodes"]}
    assert policy.admit("DELETE", kubelet, None, slice_of("node-2")) is None


def test_the_matched_identity_is_the_one_the_rbac_binds(rendered: list[Obj]) -> None:
    # a renamed service account or namespace would silently switch the policy off
    binding = one(rendered, "ClusterRoleBinding", "gpu-fraction-plugin-dra")
    (subject,) = binding["subjects"]
    assert f"system:serviceaccount:{subject['namespace']}:{subject['name']}" == AGENT
    (account,) = find(rendered, "ServiceAccount")
    assert (account["metadata"]["namespace"], account["metadata"]["name"]) == (
        subject["namespace"], subject["name"])  # fmt: skip
    (vap_binding,) = [b for b in find(rendered, "ValidatingAdmissionPolicyBinding")
                      if b["spec"]["policyName"] == "gpu-fraction-resourceslices"]  # fmt: skip
    assert vap_binding["spec"]["validationActions"] == ["Deny"]


def test_the_policy_is_not_in_the_default_install(tmp_path: Path) -> None:
    names = [o["metadata"]["name"] for o in render(overlay(tmp_path))
             if o["kind"] == "ValidatingAdmissionPolicy"]  # fmt: skip
    assert "gpu-fraction-resourceslices" not in names
