"""The sm-sharing one-GPU admission policy of the DRA component, evaluated by a real CEL
implementation (cel-python) as the API server does, against the shipped DRA examples and
variants of them: an sm-sharing claim or claim template must ask for one device, in its only
request."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.kustomize_render import DAEMONSET, Obj, find, one, overlay, render
from tests.test_admission import Policy

NAME = "gpu-fraction-sm-sharing-one-gpu"
SM = "sm-sharing.gpu-fraction.dev"
TS = "time-slicing.gpu-fraction.dev"


@pytest.fixture(scope="module")
def component(tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    return render(overlay(tmp_path_factory.mktemp("dra"), "dra"))


@pytest.fixture(scope="module")
def policy(component: list[Obj]) -> Policy:
    return Policy(one(component, "ValidatingAdmissionPolicy", NAME)["spec"])


@pytest.fixture(scope="module")
def examples() -> list[Obj]:
    return render(DAEMONSET / "examples" / "dra")


def template(*requests: Obj, kind: str = "ResourceClaimTemplate") -> Obj:
    spec: Obj = {"devices": {"requests": list(requests)}}
    body = {"spec": spec} if kind == "ResourceClaimTemplate" else spec
    return {"apiVersion": "resource.k8s.io/v1", "kind": kind, "metadata": {"name": "c"},
            "spec": body}  # fmt: skip


def exactly(name: str, cls: str, **more: Any) -> Obj:
    return {"name": name, "exactly": {"deviceClassName": cls, **more}}


def test_the_policy_covers_claims_and_templates_on_create(component: list[Obj]) -> None:
    vap = one(component, "ValidatingAdmissionPolicy", NAME)
    (rule,) = vap["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["resource.k8s.io"] and rule["operations"] == ["CREATE"]
    assert set(rule["resources"]) == {"resourceclaims", "resourceclaimtemplates"}
    binding = one(component, "ValidatingAdmissionPolicyBinding", NAME)
    assert binding["spec"]["policyName"] == NAME
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_every_shipped_claim_template_is_admitted(policy: Policy, examples: list[Obj]) -> None:
    shipped = find(examples, "ResourceClaimTemplate") + find(examples, "ResourceClaim")
    assert any(
        r["exactly"]["deviceClassName"] == SM
        for t in shipped
        for r in t["spec"]["spec"]["devices"]["requests"]
    )
    for obj in shipped:
        assert policy.admits(obj), obj["metadata"]["name"]


@pytest.mark.parametrize("kind", ["ResourceClaimTemplate", "ResourceClaim"])
@pytest.mark.parametrize(
    ("requests", "admitted"),
    [
        ([exactly("gpu", SM)], True),
        ([exactly("gpu", SM, count=1, allocationMode="ExactCount")], True),
        ([exactly("gpu", TS, count=2), exactly("more", TS)], True),
        ([exactly("gpu", SM, count=2)], False),  # the old two-gpus example
        ([exactly("gpu", SM, allocationMode="All")], False),
        ([exactly("gpu", SM), exactly("more", TS)], False),
        ([exactly("a", SM), exactly("b", SM)], False),
        ([{"name": "gpu", "firstAvailable": [{"name": "s", "deviceClassName": SM}]}], True),
        (
            [{"name": "gpu", "firstAvailable": [
                {"name": "two", "deviceClassName": SM, "count": 2},
                {"name": "one", "deviceClassName": SM}]}],
            False,
        ),
        (
            [{"name": "gpu", "firstAvailable": [{"name": "s", "deviceClassName": SM}]},
             exactly("x", TS)],
            False,
        ),
    ],
)  # fmt: skip
def test_sm_sharing_asks_one_device_in_its_only_request(
    policy: Policy, kind: str, requests: list[Obj], admitted: bool
) -> None:
    assert policy.admits(template(*copy.deepcopy(requests), kind=kind)) is admitted


def test_a_claim_without_requests_is_admitted(policy: Policy) -> None:
    obj = template(kind="ResourceClaim")
    del obj["spec"]["devices"]
    assert policy.admits(obj)
