"""The admission policy's CEL rules, evaluated by a real CEL implementation (cel-python)
against the example pods and variants of them: allowed and rejected.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes

from deviceplugin.config import settings
from tests.kustomize_render import DAEMONSET, Obj, one, overlay, render

# The pod env policy (components/admission-policy); the base has the agent's own too.
RESERVED_ENV = "gpu-fraction-reserved-env"

RESERVED = ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_GPU_MEMORY_REQUEST", "NVIDIA_GPU_MEMORY_LIMIT")
NAMES = settings.ResourceNames()
# What the policy guards by default: the fractional resources. nvidia.com/gpu (exclusive) is
# also the name NVIDIA's own plugin serves, so it stays out unless configured.
OURS = (NAMES.time_slicing, NAMES.sm_sharing)


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
    return Policy(one(rendered, "ValidatingAdmissionPolicy", RESERVED_ENV)["spec"])


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
    checked = 0
    for p in pods_of(render(DAEMONSET / "examples")):
        if not requests_any(p, OURS):
            continue  # the exclusive example: nvidia.com/gpu is not guarded by default
        assert not policy.admits(with_env(p, variable)), p["metadata"].get("name")
        checked += 1
    assert checked == 6


def requests_any(p: Obj, names: tuple[str, ...]) -> bool:
    containers = [*p["spec"]["containers"], *p["spec"].get("initContainers", [])]
    return any(
        name in c.get("resources", {}).get(kind, {})
        for c in containers
        for kind in ("limits", "requests")
        for name in names
    )


def test_another_plugins_nvidia_com_gpu_is_left_alone_by_default(policy: Policy) -> None:
    """NVIDIA's device plugin serves nvidia.com/gpu too; its pods may set caps of their own
    (only NVIDIA_VISIBLE_DEVICES is refused everywhere: rule 3)."""
    for variable in (*RESERVED[1:], "CUDA_MPS_PIPE_DIRECTORY"):
        assert policy.admits(with_env(pod(resource=NAMES.exclusive), variable)), variable
    assert policy.admits(env_from(pod(resource=NAMES.exclusive), None))


def test_whole_gpus_join_with_their_component(tmp_path: Path) -> None:
    """Where this plugin serves nvidia.com/gpu: admission-policy-whole-gpus guards it too."""
    root = overlay(tmp_path / "whole", "admission-policy", "admission-policy-whole-gpus")
    whole = Policy(one(render(root), "ValidatingAdmissionPolicy", RESERVED_ENV)["spec"])
    for resource in (*OURS, NAMES.exclusive):
        assert whole.admits(pod(resource=resource)), resource
        for variable in (*RESERVED, "CUDA_MPS_PIPE_DIRECTORY"):
            assert not whole.admits(with_env(pod(resource=resource), variable)), variable
        assert not whole.admits(env_from(pod(resource=resource), None))
    assert whole.admits(with_env(pod(resource="nvidia.com/mig-1g.10gb"), "CUDA_MPS_X"))


def env_from(p: Obj, prefix: str | None, kind: str = "configMapRef") -> Obj:
    p = copy.deepcopy(p)
    source: Obj = {kind: {"name": "settings"}}
    if prefix is not None:
        source["prefix"] = prefix
    p["spec"]["containers"][0].setdefault("envFrom", []).append(source)
    return p


# Prefixes under which a source's keys could spell a reserved name, and ones that cannot.
UNSAFE_PREFIXES = [None, "", "N", "NVIDIA_", "NVIDIA_GPU_", "NVIDIA_VISIBLE_DEVICES", "C",
                   "CUDA_", "CUDA_MPS", "CUDA_MPS_", "CUDA_MPS_PIPE"]  # fmt: skip
SAFE_PREFIXES = ["APP_", "X", "NVIDIA_DRIVER_", "CUDA_CACHE_", "MY_CUDA_MPS_"]


@pytest.mark.parametrize("prefix", UNSAFE_PREFIXES)
@pytest.mark.parametrize("kind", ["configMapRef", "secretRef"])
def test_env_from_without_a_safe_prefix_is_refused(
    policy: Policy, prefix: str | None, kind: str
) -> None:
    for resource in OURS:
        assert not policy.admits(env_from(pod(resource=resource), prefix, kind)), prefix
    # Init containers count too.
    init = pod(resource=None)
    init["spec"]["initContainers"] = [
        {"name": "warm", "image": "x", "resources": {"limits": {NAMES.sm_sharing: 1}},
         "envFrom": [{kind: {"name": "s"}, **({} if prefix is None else {"prefix": prefix})}]}
    ]  # fmt: skip
    assert not policy.admits(init)


@pytest.mark.parametrize("prefix", SAFE_PREFIXES)
def test_env_from_under_a_safe_prefix_is_admitted(policy: Policy, prefix: str) -> None:
    assert policy.admits(env_from(pod(), prefix))
    assert policy.admits(env_from(pod(resource=None), None))  # not our pod: its business


@pytest.mark.parametrize("value", ["all", "0", "GPU-6f73072a", "0,1", ""])
@pytest.mark.parametrize("resource", [None, "cpu", NAMES.exclusive, "nvidia.com/mig-1g.10gb"])
def test_no_pod_selects_gpus_through_nvidia_visible_devices(
    policy: Policy, value: str, resource: str | None
) -> None:
    """A runtime that honours the variable would hand any pod any GPU, ours included."""
    p = pod(resource=resource, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": value}])
    assert not policy.admits(p)
    from_field = pod(
        resource=resource,
        env=[{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}],
    )
    assert not policy.admits(from_field)


@pytest.mark.parametrize("value", ["void", "none"])
def test_nvidia_visible_devices_may_ask_for_no_gpu(policy: Policy, value: str) -> None:
    assert policy.admits(
        pod(resource=None, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": value}])
    )


def test_the_plugins_own_namespace_is_exempt(rendered: list[Obj]) -> None:
    """The plugin's pod sets NVIDIA_VISIBLE_DEVICES=all: its namespace opts out, or the
    default install could not start the plugin."""
    namespace = one(rendered, "Namespace")
    binding = one(rendered, "ValidatingAdmissionPolicyBinding", RESERVED_ENV)["spec"]
    assert not selects(
        binding["matchResources"]["namespaceSelector"], namespace["metadata"]["labels"]
    )
    ds = one(rendered, "DaemonSet")
    assert ds["metadata"]["namespace"] == namespace["metadata"]["name"]
    plugin_pod = {"apiVersion": "v1", "kind": "Pod", **ds["spec"]["template"]}
    assert not Policy(one(rendered, "ValidatingAdmissionPolicy", RESERVED_ENV)["spec"]).admits(
        plugin_pod
    )


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
        # Not our resources: NVIDIA's caps and MPS variables are the pod's business.
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


def test_the_guarded_resource_names_are_configurable(tmp_path: Path) -> None:
    """An overlay that renamed its resources (or serves nvidia.com/gpu itself) replaces the
    first variable, as docs/deploy.md shows; the rest of the policy follows it."""
    root = overlay(tmp_path / "renamed", "admission-policy")
    kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
    names = ["example.com/gpu-share", NAMES.exclusive]
    patch = [
        {
            "op": "replace",
            "path": "/spec/variables/0",
            "value": {"name": "ourResources", "expression": json.dumps(names)},
        }
    ]
    kustomization["patches"] = [
        {
            "target": {"kind": "ValidatingAdmissionPolicy", "name": "gpu-fraction-reserved-env"},
            "patch": yaml.safe_dump(patch),
        }
    ]
    (root / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    renamed = Policy(one(render(root), "ValidatingAdmissionPolicy", RESERVED_ENV)["spec"])
    for resource in names:
        assert renamed.admits(pod(resource=resource))
        assert not renamed.admits(with_env(pod(resource=resource), "NVIDIA_GPU_MEMORY_LIMIT"))
    assert renamed.admits(with_env(pod(resource=NAMES.time_slicing), "NVIDIA_GPU_MEMORY_LIMIT"))


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector, as the API server applies it."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def test_binding_applies_everywhere_except_namespaces_that_opt_out(
    rendered: list[Obj],
) -> None:
    spec = one(rendered, "ValidatingAdmissionPolicyBinding", RESERVED_ENV)["spec"]
    selector = spec["matchResources"]["namespaceSelector"]
    assert selects(selector, {})
    assert selects(selector, {"kubernetes.io/metadata.name": "team-a"})
    assert selects(selector, {"gpu-fraction.dev/admission": "enforce"})
    assert not selects(selector, {"gpu-fraction.dev/admission": "skip"})


def test_policy_lists_exactly_the_default_resource_names(rendered: list[Obj]) -> None:
    spec = one(rendered, "ValidatingAdmissionPolicy", RESERVED_ENV)["spec"]
    expression = next(v for v in spec["variables"] if v["name"] == "ourResources")["expression"]
    env = celpy.Environment()
    listed = env.program(env.compile(expression)).evaluate({})
    assert sorted(str(x) for x in listed) == sorted(OURS)


def test_policy_scope_and_binding(rendered: list[Obj]) -> None:
    vap = one(rendered, "ValidatingAdmissionPolicy", RESERVED_ENV)
    spec = vap["spec"]
    assert spec["failurePolicy"] == "Fail"
    rules = spec["matchConstraints"]["resourceRules"]
    assert rules == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
    ]
    message = spec["validations"][0]["message"]
    for name in (*RESERVED, "CUDA_MPS_", *OURS):
        assert name in message
    assert NAMES.exclusive not in message.replace(NAMES.time_slicing, "")
    binding = one(rendered, "ValidatingAdmissionPolicyBinding", RESERVED_ENV)
    assert binding["spec"]["policyName"] == vap["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]


@pytest.mark.parametrize(
    ("resources", "admitted"),
    [
        ({NAMES.sm_sharing: 4}, True),
        ({NAMES.time_slicing: 4, NAMES.exclusive: 1}, True),
        ({NAMES.sm_sharing: 4, NAMES.time_slicing: 2}, False),
        ({NAMES.sm_sharing: 4, NAMES.exclusive: 1}, False),
    ],
)
@pytest.mark.parametrize("kind", ["limits", "requests"])
def test_an_sm_sharing_container_requests_no_other_gpu(
    policy: Policy, resources: dict[str, int], admitted: bool, kind: str
) -> None:
    """One MPS control daemon per client, and two of our CDI devices in one container keep
    the last device's variables: an sm-sharing container gets exactly one GPU."""
    assert policy.admits(pod(resources={kind: dict(resources)})) is admitted
    # in different containers of one pod, each is fine
    p = pod(resources={kind: {NAMES.sm_sharing: 4}})
    p["spec"]["containers"].append(
        {"name": "other", "image": "cuda", "resources": {kind: {NAMES.time_slicing: 2}}}
    )
    assert policy.admits(p)
