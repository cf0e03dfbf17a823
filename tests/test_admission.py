"""The admission policy's CEL rules, evaluated by a real CEL implementation (cel-python)
against the example pods and variants of them: allowed and rejected.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import celpy
import pytest
from celpy import celtypes

from deviceplugin import config
from tests.kustomize_render import DAEMONSET, Obj, one, render

RESERVED = ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_GPU_MEMORY_REQUEST", "NVIDIA_GPU_MEMORY_LIMIT")
NAMES = config.ResourceNames()
OURS = (NAMES.time_slicing, NAMES.sm_sharing, NAMES.exclusive)


class Policy:
    """Evaluates a ValidatingAdmissionPolicy's variables and validations as the API server does."""

    def __init__(self, spec: Obj) -> None:
        env = celpy.Environment()
        self.variables = [
            (v["name"], env.program(env.compile(v["expression"]))) for v in spec["variables"]
        ]
        self.validations = [env.program(env.compile(v["expression"])) for v in spec["validations"]]

    def admits(self, pod: Obj) -> bool:
        variables = celtypes.MapType({})
        activation: dict[str, Any] = {"object": celpy.json_to_cel(pod), "variables": variables}
        for name, program in self.variables:
            variables[celtypes.StringType(name)] = program.evaluate(activation)
        results = [program.evaluate(activation) for program in self.validations]
        for r in results:
            assert isinstance(r, celtypes.BoolType), f"validation evaluated to {r!r}"
        return all(bool(r) for r in results)


@pytest.fixture(scope="module")
def rendered() -> list[Obj]:
    return render(DAEMONSET)


@pytest.fixture(scope="module")
def policy(rendered: list[Obj]) -> Policy:
    return Policy(one(rendered, "ValidatingAdmissionPolicy")["spec"])


def pods_of(objects: list[Obj]) -> list[Obj]:
    """Pods, and the pods Deployments would create (the policy sees those)."""
    out = []
    for o in objects:
        if o["kind"] == "Pod":
            out.append(o)
        elif o["kind"] == "Deployment":
            t = o["spec"]["template"]
            out.append({"apiVersion": "v1", "kind": "Pod", **t})
    return out


def pod(resource: str | None = NAMES.time_slicing, **container: Any) -> Obj:
    c: Obj = {"name": "app", "image": "cuda", **container}
    if resource is not None:
        c.setdefault("resources", {"limits": {resource: 2}})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": [c]},
    }


def with_env(p: Obj, name: str, where: str = "containers") -> Obj:
    p = copy.deepcopy(p)
    target = p["spec"].setdefault(where, [{"name": "extra", "image": "busybox"}])[-1]
    target.setdefault("env", []).append({"name": name, "value": "x"})
    return p


def test_examples_are_admitted(policy: Policy) -> None:
    examples = pods_of(render(DAEMONSET / "examples"))
    assert len(examples) == 7
    for p in examples:
        assert policy.admits(p), p["metadata"].get("name")


@pytest.mark.parametrize("variable", [*RESERVED, "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ANYTHING"])
def test_examples_setting_a_reserved_variable_are_rejected(policy: Policy, variable: str) -> None:
    for p in pods_of(render(DAEMONSET / "examples")):
        assert not policy.admits(with_env(p, variable)), p["metadata"].get("name")


@pytest.mark.parametrize("resource", OURS)
@pytest.mark.parametrize("kind", ["limits", "requests"])
def test_each_resource_in_limits_or_requests_triggers_the_rule(
    policy: Policy, resource: str, kind: str
) -> None:
    p = pod(resources={kind: {resource: 1}})
    assert policy.admits(p)
    assert not policy.admits(with_env(p, "NVIDIA_GPU_MEMORY_LIMIT"))


def test_reserved_env_in_a_container_without_gpus_still_counts(policy: Policy) -> None:
    # The app container asks for slices; a sidecar sets CUDA_MPS_* for it.
    p = pod()
    p["spec"]["containers"].append(
        {"name": "sidecar", "image": "x", "env": [{"name": "CUDA_MPS_PIPE_DIRECTORY"}]}
    )
    assert not policy.admits(p)


def test_init_containers_count_for_resources_and_env(policy: Policy) -> None:
    init_only = pod(resource=None)
    init_only["spec"]["initContainers"] = [
        {"name": "warm", "image": "x", "resources": {"limits": {NAMES.sm_sharing: 1}}}
    ]
    assert policy.admits(init_only)
    assert not policy.admits(with_env(init_only, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
    assert not policy.admits(with_env(pod(), "NVIDIA_VISIBLE_DEVICES", where="initContainers"))


@pytest.mark.parametrize(
    "make",
    [
        # Not our resources: NVIDIA's own variables are the pod's business.
        lambda: with_env(pod(resource=None), "NVIDIA_VISIBLE_DEVICES"),
        lambda: with_env(pod(resource="nvidia.com/mig-1g.10gb"), "CUDA_MPS_PIPE_DIRECTORY"),
        lambda: with_env(pod(resource="cpu"), "NVIDIA_GPU_MEMORY_LIMIT"),
        # Our resources, other variables, including look-alikes.
        lambda: with_env(pod(), "CUDA_VISIBLE_DEVICES"),
        lambda: with_env(pod(), "MY_CUDA_MPS_SETTING"),
        lambda: with_env(pod(), "NVIDIA_DRIVER_CAPABILITIES"),
        lambda: pod(env=[]),
        lambda: pod(resources={}),
    ],
)
def test_allowed(policy: Policy, make: Callable[[], Obj]) -> None:
    assert policy.admits(make())


def test_policy_lists_exactly_the_default_resource_names(rendered: list[Obj]) -> None:
    spec = one(rendered, "ValidatingAdmissionPolicy")["spec"]
    expression = next(v for v in spec["variables"] if v["name"] == "ourResources")["expression"]
    env = celpy.Environment()
    listed = env.program(env.compile(expression)).evaluate({})
    assert sorted(str(x) for x in listed) == sorted(OURS)


def test_policy_scope_and_binding(rendered: list[Obj]) -> None:
    vap = one(rendered, "ValidatingAdmissionPolicy")
    spec = vap["spec"]
    assert spec["failurePolicy"] == "Fail"
    rules = spec["matchConstraints"]["resourceRules"]
    assert rules == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
    ]
    message = spec["validations"][0]["message"]
    for name in (*RESERVED, "CUDA_MPS_", *OURS):
        assert name in message
    binding = one(rendered, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {
        "policyName": vap["metadata"]["name"],
        "validationActions": ["Deny"],
    }
