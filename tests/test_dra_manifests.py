"""The `dra` component and the DRA examples: they render, every object validates strictly
against the Kubernetes 1.34-1.37 schemas, and the DeviceClass selectors, evaluated by a real CEL
implementation (cel-python), pick exactly the devices of their mode from the ResourceSlices the
plugin builds for a simulated node with every mode, and nothing another driver publishes.
"""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from celpy import celtypes

from deviceplugin import flags
from deviceplugin.config import settings
from deviceplugin.dra import slices
from deviceplugin.inventory.gpus import read_inventory
from deviceplugin.inventory.nvml import NvmlSession
from deviceplugin.model import Mode, ServingApi
from deviceplugin.plan import build_plan
from deviceplugin.quantity import parse_quantity
from tests.conftest import MakeFake
from tests.kustomize_render import DAEMONSET, REPO, Obj, find, one, overlay, render

# resource.k8s.io/v1 is served from 1.34; these are the versions the installed
# kubernetes-validate ships schemas for from there on (a missing one fails the test).
K8S_VERSIONS = ("1.34.0", "1.35.0", "1.36.0", "1.37.0")
DRIVER = slices.DRIVER
EXAMPLES = DAEMONSET / "examples" / "dra"
BASE_CONFIG_LINE = "# api: device-plugin\n"
DRA_CONFIG_LINE = "api: dra\n"

# A node with every mode on DRA: two H200 and two L4 (the `mixed` preset), sm-sharing twice so
# a class matches more than one GPU and the two-GPU example has somewhere to go.
NODE_MODES = {0: Mode.TIME_SLICING, 1: Mode.SM_SHARING, 2: Mode.EXCLUSIVE, 3: Mode.TIME_SLICING}
NODE_CONFIG = {
    "version": "v1",
    "api": "dra",
    "gpus": [{"match": {"index": i}, "mode": m.value} for i, m in NODE_MODES.items()],
}


@pytest.fixture(scope="module")
def component(tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    return render(overlay(tmp_path_factory.mktemp("dra"), "dra"))


@pytest.fixture(scope="module")
def base() -> list[Obj]:
    return render(DAEMONSET / "base")


@pytest.fixture(scope="module")
def examples() -> list[Obj]:
    return render(EXAMPLES)


@pytest.fixture(params=[True, False], ids=["consumable", "gate-off"])
def node_devices(
    make_fake: MakeFake, tmp_path: Path, request: pytest.FixtureRequest
) -> list[tuple[str, Obj]]:
    """(driver, device) for every device in the ResourceSlices the plugin builds for the node:
    as published with consumable capacity, and as republished after the API server dropped it
    (fractional GPUs as whole devices): the classes must select the same GPUs either way."""
    fake = make_fake("mixed")
    sysfs = tmp_path / "sys"
    fake.spec.write_sysfs(sysfs)
    with NvmlSession.open() as session:
        inventory = read_inventory(
            session, sysfs, "/nonexistent/nvidia-ctk", fake.spec.node_facts()
        )
    plan = build_plan(inventory, settings.parse(NODE_CONFIG))
    assert {p.gpu.index: p.mode for p in plan.dra_gpus} == NODE_MODES, "every GPU served by DRA"
    built = slices.build(
        plan,
        owner=slices.Owner("gpu-node-1", "uid-gpu-node-1"),
        generation=1,
        driver_version=inventory.node.driver_version,
        multi_allocation=request.param,
    )
    return [(s["spec"]["driver"], d) for s in built for d in s["spec"]["devices"]]


# Devices other drivers publish: NVIDIA's full GPU, and a driver that (legally) publishes an
# attribute in our domain with one of our mode values.
FOREIGN_DEVICES: list[tuple[str, Obj]] = [
    (
        "gpu.nvidia.com",
        {
            "name": "gpu-0",
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": "GPU-12345678-1234-1234-1234-123456789abc"},
                "productName": {"string": "NVIDIA H200"},
            },
            "capacity": {"memory": {"value": "141Gi"}},
        },
    ),
    (
        "other.example.com",
        {"name": "dev-0", "attributes": {f"{DRIVER}/mode": {"string": "time-slicing"}}},
    ),
]


def cel_device(driver: str, device: Obj) -> celtypes.MapType:
    """A slice device as the API server's DRA CEL environment shows it to a selector.

    Unqualified attribute names belong to the driver's domain; `string`, `int` and `bool` values
    are CEL values. Versions and capacities (semver and Quantity types, which cel-python lacks)
    are left out, so a selector that reads them fails here rather than passing by accident.
    """
    domains: dict[str, dict[str, Any]] = {}
    for name, value in device.get("attributes", {}).items():
        domain, _, ident = name.rpartition("/")
        ((kind, raw),) = value.items()
        if kind == "version":
            continue
        cel = {"string": celtypes.StringType, "int": celtypes.IntType, "bool": celtypes.BoolType}
        domains.setdefault(domain or driver, {})[ident] = cel[kind](raw)
    attributes = celtypes.MapType(
        {
            celtypes.StringType(d): celtypes.MapType(
                {celtypes.StringType(k): v for k, v in values.items()}
            )
            for d, values in domains.items()
        }
    )
    return celtypes.MapType(
        {
            celtypes.StringType("driver"): celtypes.StringType(driver),
            celtypes.StringType("attributes"): attributes,
            celtypes.StringType("allowMultipleAllocations"): celtypes.BoolType(
                bool(device.get("allowMultipleAllocations", False))
            ),
        }
    )


class DeviceClass:
    """A DeviceClass's selectors, compiled once; all must be true, as for the allocator."""

    def __init__(self, obj: Obj) -> None:
        env = celpy.Environment()
        self.name = obj["metadata"]["name"]
        self.programs = [
            env.program(env.compile(s["cel"]["expression"])) for s in obj["spec"]["selectors"]
        ]

    def matches(self, driver: str, device: Obj) -> bool:
        activation = {"device": cel_device(driver, device)}
        results = [p.evaluate(activation) for p in self.programs]
        for r in results:
            # An error (a missing attribute on another driver's device) would fail every claim
            # of the class in the scheduler, not just skip the device.
            assert isinstance(r, celtypes.BoolType), f"{self.name}: {device['name']} gave {r!r}"
        return all(bool(r) for r in results)


def classes(objects: list[Obj]) -> dict[str, DeviceClass]:
    return {o["metadata"]["name"]: DeviceClass(o) for o in find(objects, "DeviceClass")}


def class_name(mode: Mode) -> str:
    return f"{mode.value}.{DRIVER}"


def attribute(device: Obj, name: str) -> Any:
    ((_, value),) = device["attributes"][name].items()
    return value


# --- rendering and schemas ----------------------------------------------------------------


def test_component_adds_classes_rbac_the_sm_sharing_policy_and_nothing_else(
    component: list[Obj], base: list[Obj]
) -> None:
    def keys(objects: list[Obj]) -> list[tuple[str, str]]:
        return sorted((o["kind"], o["metadata"]["name"]) for o in objects)

    added = sorted(set(keys(component)) - set(keys(base)))
    assert added == sorted(
        [("DeviceClass", class_name(m)) for m in Mode]
        + [
            ("ClusterRole", "gpu-fraction-plugin-dra"),
            ("ClusterRoleBinding", "gpu-fraction-plugin-dra"),
            # only the agent's own node's slices (tests/test_slice_policy.py)
            ("ValidatingAdmissionPolicy", "gpu-fraction-resourceslices"),
            ("ValidatingAdmissionPolicyBinding", "gpu-fraction-resourceslices"),
            # only claims allocated to its node (tests/test_confinement_policies.py)
            ("ValidatingAdmissionPolicy", "gpu-fraction-resourceclaim-status"),
            ("ValidatingAdmissionPolicyBinding", "gpu-fraction-resourceclaim-status"),
            ("ValidatingAdmissionPolicy", "gpu-fraction-sm-sharing-one-gpu"),
            ("ValidatingAdmissionPolicyBinding", "gpu-fraction-sm-sharing-one-gpu"),
        ]
    )
    assert set(keys(base)) <= set(keys(component))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_kubernetes_schemas(
    component: list[Obj], examples: list[Obj], version: str
) -> None:
    checked = 0
    for name, objects in (("base+dra", component), ("examples/dra", examples)):
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {err.message}")
            checked += 1
    kinds = {o["kind"] for o in component + examples}
    assert {"DeviceClass", "ResourceClaimTemplate", "Pod", "ClusterRole"} <= kinds
    assert checked == len(component) + len(examples) >= 20


def test_validation_is_strict_for_the_dra_kinds(examples: list[Obj]) -> None:
    # The schemas know these kinds: a misspelt field fails, so the test above can fail.
    template = copy.deepcopy(find(examples, "ResourceClaimTemplate")[0])
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacityy"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(template, K8S_VERSIONS[0], strict=True)


# --- the component ------------------------------------------------------------------------


def plugin_pod(objects: list[Obj]) -> Obj:
    spec: Obj = one(objects, "DaemonSet", "gpu-fraction-plugin")["spec"]["template"]["spec"]
    return spec


def test_kubelet_plugin_dirs_are_mounted_at_the_flag_defaults(component: list[Obj]) -> None:
    pod = plugin_pod(component)
    (container,) = [c for c in pod["containers"] if c["name"] == "plugin"]
    paths = [m["mountPath"] for m in container["volumeMounts"]]
    # The API server refuses a pod with two mounts at one path.
    assert len(paths) == len(set(paths))
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    defaults = {f.name: f.default for f in flags.RUN_FLAGS}
    for flag in ("--kubelet-plugins-dir", "--kubelet-registry-dir"):
        path = defaults[flag]
        mount = mounts[path]
        # The plugin creates its sockets there, and GetInfo hands the kubelet the DRA socket's
        # path: the host path and the container path must be the same.
        assert not mount.get("readOnly"), flag
        assert volumes[mount["name"]]["hostPath"]["path"] == path, flag


def test_component_changes_only_the_rollout_and_the_instance_id_of_the_daemonset(
    component: list[Obj], base: list[Obj]
) -> None:
    """Rolling updates of a DRA plugin (kubelet 1.33+): the new pod beside the old one
    (surge, never one down), each naming its sockets with its pod UID."""
    ours, theirs = copy.deepcopy(one(component, "DaemonSet")), one(base, "DaemonSet")
    assert ours["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    env = ours["spec"]["template"]["spec"]["containers"][0]["env"]
    (instance,) = [e for e in env if e["name"] == "GPU_FRACTION_DRA_INSTANCE"]
    assert instance["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert any(f.env == instance["name"] for f in flags.RUN_FLAGS)
    env.remove(instance)
    ours["spec"]["updateStrategy"] = theirs["spec"]["updateStrategy"]
    assert ours == theirs


def test_config_is_the_base_config_with_api_dra(component: list[Obj], base: list[Obj]) -> None:
    base_text = one(base, "ConfigMap")["data"]["config.yaml"]
    dra_text = one(component, "ConfigMap")["data"]["config.yaml"]
    assert base_text.count(BASE_CONFIG_LINE) == 1
    # kustomize drops a patched value's final newline; everything else must stay in step.
    wanted = base_text.replace(BASE_CONFIG_LINE, DRA_CONFIG_LINE)
    assert dra_text.rstrip("\n") == wanted.rstrip("\n")
    base_config = settings.parse(yaml.safe_load(base_text))
    assert settings.parse(yaml.safe_load(dra_text)) == replace(base_config, api=ServingApi.DRA)


# (apiGroup, resource, verb) the DRA front-end uses: the publisher reconciles this node's
# ResourceSlices, prepare GETs the claims the kubelet names (never a list or watch of claims),
# the claim status carries the allocation record (UPDATE), and the mode classes can be checked
# (read-only).
NEEDED = [
    *[
        ("resource.k8s.io", "resourceslices", v)
        for v in ("list", "watch", "create", "update", "delete")
    ],
    ("resource.k8s.io", "resourceclaims", "get"),
    ("resource.k8s.io", "resourceclaims/status", "patch"),
]


def allows(rules: list[Obj], group: str, resource: str, verb: str, name: str | None = None) -> bool:
    return any(
        group in r["apiGroups"]
        and resource in r["resources"]
        and verb in r["verbs"]
        and (not r.get("resourceNames") or name in r["resourceNames"])
        for r in rules
    )


def test_rbac_grants_what_the_dra_front_end_needs(component: list[Obj]) -> None:
    role = one(component, "ClusterRole", "gpu-fraction-plugin-dra")
    rules = role["rules"]
    for group, resource, verb in NEEDED:
        assert allows(rules, group, resource, verb), (resource, verb)
    # 1.36+ granular status authorisation: the synthetic subresource, the node-scoped form of
    # the request's verb (our status write is an apply, a patch), for our driver only (never
    # arbitrary-node, never another driver's entries).
    assert allows(
        rules, "resource.k8s.io", "resourceclaims/driver", "associated-node:patch", DRIVER
    )
    (driver_rule,) = [r for r in rules if "resourceclaims/driver" in r["resources"]]
    assert driver_rule["resourceNames"] == [DRIVER]
    assert not any(v.startswith("arbitrary-node:") for v in driver_rule["verbs"])
    # KEP-4817's synthetic check on `drivers`, for our driver only
    assert allows(rules, "resource.k8s.io", "drivers", "update-device-status", DRIVER)
    (drivers_rule,) = [r for r in rules if "drivers" in r["resources"]]
    assert drivers_rule["resourceNames"] == [DRIVER]
    # Least privilege: nothing beyond the list above and the driver rule.
    granted = {
        (g, res, v)
        for r in rules
        for g in r["apiGroups"]
        for res in r["resources"]
        for v in r["verbs"]
    }
    expected = (
        set(NEEDED)
        | {("resource.k8s.io", "resourceclaims/driver", "associated-node:patch")}
        | {("resource.k8s.io", "drivers", "update-device-status")}
    )
    assert granted == expected


# A kubernetes-client ResourceV1Api call and the RBAC verb it needs.
API_CALL = re.compile(
    r"\.(list|create|replace|patch|delete|read)_(?:namespaced_)?"
    r"(resource_slice|resource_claim|device_class)(_status)?(?:_for_all_namespaces)?\b"
)
VERBS = {
    "list": "list",
    "create": "create",
    "replace": "update",
    "patch": "patch",
    "delete": "delete",
    "read": "get",
}


def test_rbac_covers_every_resource_call_the_code_makes(component: list[Obj]) -> None:
    rules = one(component, "ClusterRole", "gpu-fraction-plugin-dra")["rules"]
    calls = set()
    for path in (REPO / "deviceplugin").rglob("*.py"):
        for m in API_CALL.finditer(path.read_text()):
            resource = m[2].replace("_", "") + "s" + ("/status" if m[3] else "")
            calls.add((resource, VERBS[m[1]]))
            if m[1] == "list":
                calls.add((resource, "watch"))  # the client's watches are lists with watch=True
    assert ("resourceslices", "create") in calls, "the scan finds the publisher's calls"
    for resource, verb in sorted(calls):
        assert allows(rules, "resource.k8s.io", resource, verb), (resource, verb)
    # and nothing the code does not call (issue 33: RBAC grants no more than the code uses)
    assert {(res, v) for _, res, v in NEEDED} == calls


def test_rbac_is_bound_to_the_plugin_service_account(component: list[Obj]) -> None:
    binding = one(component, "ClusterRoleBinding", "gpu-fraction-plugin-dra")
    sa = one(component, "ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "gpu-fraction-plugin-dra",
    }
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": sa["metadata"]["name"],
            "namespace": sa["metadata"]["namespace"],
        }
    ]
    assert plugin_pod(component)["serviceAccountName"] == sa["metadata"]["name"]


# --- the DeviceClass selectors against the plugin's slices ---------------------------------


def test_one_class_per_mode(component: list[Obj]) -> None:
    found = classes(component)
    assert set(found) == {class_name(m) for m in Mode}
    for obj in find(component, "DeviceClass"):
        assert len(obj["spec"]["selectors"]) == 1
        assert set(obj["spec"]) == {"selectors"}, "no class config: claims carry their own"


def test_each_class_matches_exactly_the_devices_of_its_mode(
    component: list[Obj], node_devices: list[tuple[str, Obj]]
) -> None:
    found = classes(component)
    ours = [d for drv, d in node_devices if drv == DRIVER]
    assert sorted(d["name"] for d in ours) == [f"gpu-{i}" for i in sorted(NODE_MODES)]
    for mode in Mode:
        cls = found[class_name(mode)]
        matched = sorted(
            d["name"] for drv, d in node_devices + FOREIGN_DEVICES if cls.matches(drv, d)
        )
        wanted = sorted(f"gpu-{i}" for i, m in NODE_MODES.items() if m is mode)
        assert matched == wanted, mode
        # The slices say the mode the same way the plan does.
        for d in ours:
            assert (attribute(d, "mode") == mode.value) == (d["name"] in wanted)


def test_classes_never_match_another_drivers_devices(component: list[Obj]) -> None:
    for cls in classes(component).values():
        for driver, device in FOREIGN_DEVICES:
            assert cls.matches(driver, device) is False, (cls.name, driver)
    # The driver check is what stops the second foreign device: without it the mode test alone
    # would take it.
    spoof = FOREIGN_DEVICES[1]
    mode_only = {
        "metadata": {"name": "mode-only"},
        "spec": {
            "selectors": [
                {"cel": {"expression": f'device.attributes["{DRIVER}"].mode == "time-slicing"'}}
            ]
        },
    }
    assert DeviceClass(mode_only).matches(*spoof) is True


def test_a_device_of_ours_with_another_mode_value_is_not_matched(
    component: list[Obj], node_devices: list[tuple[str, Obj]]
) -> None:
    # A mode the classes do not know (a future one) matches none of them.
    driver, device = next((drv, d) for drv, d in node_devices if drv == DRIVER)
    device = copy.deepcopy(device)
    device["attributes"]["mode"] = {"string": "partitioned"}
    assert not any(cls.matches(driver, device) for cls in classes(component).values())


# --- the examples ---------------------------------------------------------------------------


def templates(examples: list[Obj]) -> dict[str, Obj]:
    return {
        t["metadata"]["name"]: t["spec"]["spec"] for t in find(examples, "ResourceClaimTemplate")
    }


def requests(examples: list[Obj]) -> list[tuple[str, Obj]]:
    return [
        (name, r["exactly"])
        for name, spec in templates(examples).items()
        for r in spec["devices"]["requests"]
    ]


def test_pods_reference_their_templates_and_claims(examples: list[Obj]) -> None:
    known = templates(examples)
    pods = find(examples, "Pod")
    assert len(pods) == len(known) == 5
    used = set()
    for pod in pods:
        spec = pod["spec"]
        claims = {c["name"]: c["resourceClaimTemplateName"] for c in spec["resourceClaims"]}
        assert set(claims.values()) <= known.keys(), pod["metadata"]["name"]
        used |= set(claims.values())
        for c in spec["containers"]:
            assert c["resources"]["claims"], c["name"]
            for ref in c["resources"]["claims"]:
                assert ref["name"] in claims, (pod["metadata"]["name"], ref)
        # DRA pods ask no extended resource: the GPU comes only through the claim.
        for c in spec["containers"]:
            assert set(c["resources"]) == {"claims"}
    assert used == known.keys()


def test_one_example_per_mode_each_class_installed(
    examples: list[Obj], component: list[Obj]
) -> None:
    installed = set(classes(component))
    used = {r["deviceClassName"] for _, r in requests(examples)}
    assert used == installed


def test_fractional_requests_name_an_amount_on_the_slice_grid(examples: list[Obj]) -> None:
    slice_size = settings.Config().slice_size
    for name, r in requests(examples):
        if r["deviceClassName"] == class_name(Mode.EXCLUSIVE):
            # Not multi-allocatable: the claim takes the whole device and names no amount.
            assert "capacity" not in r, name
            continue
        amount = parse_quantity(r["capacity"]["requests"]["memory"])
        assert set(r["capacity"]["requests"]) == {"memory"}, name
        assert amount == 4 * 2**30, name
        assert amount % slice_size == 0, name


def test_every_example_request_fits_the_simulated_node(
    examples: list[Obj], component: list[Obj], node_devices: list[tuple[str, Obj]]
) -> None:
    """What the scheduler checks first: enough devices of the class whose capacity policy
    admits the amount (and, for distinctAttribute, with distinct values)."""
    found = classes(component)
    for name, spec in templates(examples).items():
        for request in spec["devices"]["requests"]:
            r = request["exactly"]
            fits = [
                d
                for drv, d in node_devices
                if found[r["deviceClassName"]].matches(drv, d) and _admits(d, r)
            ]
            assert len(fits) >= r.get("count", 1), name
            for c in spec["devices"].get("constraints", []):
                if request["name"] in c["requests"]:
                    domain, _, ident = c["distinctAttribute"].partition("/")
                    assert domain == DRIVER
                    values = {attribute(d, ident) for d in fits}
                    assert len(values) >= r.get("count", 1), name


def _admits(device: Obj, request: Obj) -> bool:
    wanted = request.get("capacity", {}).get("requests", {})
    if not wanted:
        return True
    memory = device["capacity"]["memory"]
    amount = parse_quantity(wanted["memory"])
    policy = memory.get("requestPolicy")
    top = parse_quantity(policy["validRange"]["max"]) if policy else parse_quantity(memory["value"])
    return amount <= top


def test_two_gpu_example_keeps_its_shares_apart(examples: list[Obj]) -> None:
    (spec,) = [s for s in templates(examples).values() if s["devices"].get("constraints")]
    (request,) = spec["devices"]["requests"]
    assert request["exactly"]["count"] == 2
    # one container gets both: time-slicing, the same amount each (sm-sharing: one GPU only)
    assert request["exactly"]["deviceClassName"] == "time-slicing.gpu-fraction.dev"
    assert spec["devices"]["constraints"] == [
        {"requests": [request["name"]], "distinctAttribute": f"{DRIVER}/uuid"}
    ]


CEILING = {
    "apiVersion": "gpu-fraction.dev/v1",
    "kind": "GpuShareConfig",
    "memoryLimit": "8Gi",
    "activeThreadPercentage": 50,
}


def ceiling_template(examples: list[Obj]) -> Obj:
    (spec,) = [s for s in templates(examples).values() if s["devices"].get("config")]
    return spec


def test_ceiling_example_carries_the_share_config_for_our_driver(examples: list[Obj]) -> None:
    spec = ceiling_template(examples)
    (request,) = spec["devices"]["requests"]
    (entry,) = spec["devices"]["config"]
    assert entry["requests"] == [request["name"]]
    assert entry["opaque"] == {"driver": DRIVER, "parameters": CEILING}
    limit = parse_quantity(entry["opaque"]["parameters"]["memoryLimit"])
    assert limit > parse_quantity(request["exactly"]["capacity"]["requests"]["memory"])


def test_the_plugin_reads_the_ceiling_example_as_written(examples: list[Obj]) -> None:
    # The claim as the scheduler leaves it: the spec's config copied into the allocation.
    results = pytest.importorskip("deviceplugin.dra.results")
    spec = ceiling_template(examples)
    (request,) = spec["devices"]["requests"]
    claim = {
        "metadata": {"namespace": "default", "name": "dra-with-ceiling-gpu-x", "uid": "u-1"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": request["name"],
                            "driver": DRIVER,
                            "pool": "gpu-node-1",
                            "device": "gpu-1",
                            "shareID": "s-1",
                            "consumedCapacity": {"memory": "4Gi"},
                        }
                    ],
                    "config": [{**c, "source": "FromClaim"} for c in spec["devices"]["config"]],
                }
            }
        },
    }
    share = results.share_config(claim, DRIVER, request["name"])
    assert share.memory_limit == 8 * 2**30
    assert share.active_thread_percentage == 50
