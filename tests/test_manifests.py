"""The deployment manifests: they render, every object validates against the Kubernetes
schemas offline, and names, mounts, env and resource names agree with the code's own contracts.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path, PurePosixPath
from types import ModuleType

import kubernetes_validate
import pytest
import yaml

from deviceplugin.config import settings
from deviceplugin.quantity import parse_quantity
from tests.kustomize_render import (
    DAEMONSET,
    Obj,
    find,
    kubectl,
    one,
    overlay,
    render,
    render_files,
    render_kubectl,
)

# The pod env policy (components/admission-policy); the base has the agent's own too.
RESERVED_ENV = "gpu-fraction-reserved-env"

# The oldest Kubernetes the default install supports (ValidatingAdmissionPolicy v1 is 1.30)
# and the newest whose schemas the pinned kubernetes-validate ships.
K8S_VERSIONS = ("1.30.0", "1.37.0")
COMPONENTS = sorted(p.name for p in (DAEMONSET / "components").iterdir() if p.is_dir())
# Trees of resource.k8s.io/v1 objects (Kubernetes 1.34+): rendered and compared here, validated
# against 1.34-1.37 in tests/test_dra_manifests.py.
DRA_TREES = {"base+dra", "examples/dra"}


def flags_module() -> ModuleType | None:
    try:
        return importlib.import_module("deviceplugin.flags")
    except ImportError:
        return None


@pytest.fixture(scope="module")
def root() -> list[Obj]:
    return render(DAEMONSET)


@pytest.fixture(scope="module")
def examples() -> list[Obj]:
    return render(DAEMONSET / "examples")


def plugin_ds(objects: list[Obj]) -> Obj:
    return one(objects, "DaemonSet", "gpu-fraction-plugin")


def plugin_container(objects: list[Obj]) -> Obj:
    containers = plugin_ds(objects)["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "plugin")


def trees(tmp_path: Path) -> dict[str, Path]:
    out = {
        "root": DAEMONSET,
        "examples": DAEMONSET / "examples",
        "examples/dra": DAEMONSET / "examples" / "dra",
    }
    for c in COMPONENTS:
        # A component that patches another is rendered on top of it.
        needs = ("admission-policy",) if c == "admission-policy-whole-gpus" else ()
        out[f"base+{c}"] = overlay(tmp_path / c, *needs, c)
    return out


def test_root_renders_base_and_default_components(root: list[Obj]) -> None:
    kinds = sorted(o["kind"] for o in root)
    assert kinds == sorted(
        [
            "Namespace",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            "NetworkPolicy",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            # the agent's token held to its node (base/confinement.yaml): pods, nodes, events
            *["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"] * 3,
        ]
    )


def test_network_policy_admits_only_monitoring_to_the_metrics_port(root: list[Obj]) -> None:
    (policy,) = [o for o in root if o["kind"] == "NetworkPolicy"]
    ds = plugin_ds(root)
    assert policy["metadata"]["namespace"] == ds["metadata"]["namespace"]
    spec = policy["spec"]
    # It selects the plugin's pods (and so closes them to everything it does not admit).
    assert spec["podSelector"]["matchLabels"].items() <= (
        ds["spec"]["template"]["metadata"]["labels"].items()
    )
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    ports = {p["name"]: p["containerPort"] for p in plugin_container(root)["ports"]}
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}] and "metrics" in ports


@pytest.mark.skipif(kubectl() is None, reason="kubectl not installed")
def test_fallback_renderer_agrees_with_kustomize(tmp_path: Path) -> None:
    def key(o: Obj) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    for name, path in trees(tmp_path).items():
        assert sorted(render_files(path), key=key) == sorted(render_kubectl(path), key=key), name


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_kubernetes_schemas(tmp_path: Path, version: str) -> None:
    checked = 0
    for name, path in trees(tmp_path).items():
        if name in DRA_TREES:
            continue
        for obj in render(path):
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {err.message}")
            checked += 1
    assert checked >= 20


def test_every_manifest_file_is_part_of_some_rendering(tmp_path: Path) -> None:
    rendered = {
        (o["kind"], o["metadata"]["name"]) for p in trees(tmp_path).values() for o in render(p)
    }
    for path in DAEMONSET.rglob("*.yaml"):
        # The Helm chart is templates and values, checked by tests/test_chart.py.
        if path.name == "kustomization.yaml" or (DAEMONSET / "chart") in path.parents:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert (doc["kind"], doc["metadata"]["name"]) in rendered, path


def test_names_cross_reference(root: list[Obj]) -> None:
    ns = one(root, "Namespace")["metadata"]["name"]
    sa = one(root, "ServiceAccount")
    ds = plugin_ds(root)
    pod = ds["spec"]["template"]["spec"]
    for obj in root:
        if obj["kind"] in ("ServiceAccount", "ConfigMap", "DaemonSet"):
            assert obj["metadata"]["namespace"] == ns, obj["kind"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    binding = one(root, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == one(root, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": ns}
    ]
    assert (
        ds["spec"]["selector"]["matchLabels"].items()
        <= ds["spec"]["template"]["metadata"]["labels"].items()
    )
    vap = one(root, "ValidatingAdmissionPolicy", RESERVED_ENV)
    assert (
        one(root, "ValidatingAdmissionPolicyBinding", RESERVED_ENV)["spec"]["policyName"]
        == vap["metadata"]["name"]
    )


def test_config_map_is_mounted_and_named_by_the_config_variable(root: list[Obj]) -> None:
    cm = one(root, "ConfigMap")
    pod = plugin_ds(root)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if "configMap" in v)
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    mount = next(m for m in plugin_container(root)["volumeMounts"] if m["name"] == volume["name"])
    assert mount.get("readOnly") is True
    env = {e["name"]: e.get("value") for e in plugin_container(root)["env"]}
    path = PurePosixPath(env["GPU_FRACTION_CONFIG"])
    assert str(path.parent) == mount["mountPath"]
    assert path.name in cm["data"]


# What the shipped ConfigMap sets on purpose; every other key is at its default.
MANIFEST_CONFIG = settings.Config(mps=settings.MpsConfig(launcher=settings.LAUNCHER_HOST_SYSTEMD))


def test_default_config_is_valid_and_its_comments_are_the_defaults(root: list[Obj]) -> None:
    text = one(root, "ConfigMap")["data"]["config.yaml"]
    assert settings.parse(yaml.safe_load(text)) == MANIFEST_CONFIG
    # `# key: value` lines are the defaults; `##` lines are prose. Uncommenting every key must
    # give the same config, so the comments cannot drift from the code.
    uncommented = "\n".join(
        line.replace("# ", "", 1) if line.lstrip().startswith("# ") else line
        for line in text.splitlines()
        if not line.lstrip().startswith("##")
    )
    data = yaml.safe_load(uncommented)
    top_keys = {k.name for k in settings.SCHEMA}
    assert set(data) == top_keys, "every top-level key appears, commented"
    assert settings.parse(data) == MANIFEST_CONFIG


HOST_ROOT_VOLUME = "host-root"


def test_host_paths_are_mounted_at_the_same_path(root: list[Obj]) -> None:
    # The plugin hands out host paths (CDI specs, pipe dirs): both views must agree. Only the
    # host's root, read through --host-root, sits elsewhere.
    pod = plugin_ds(root)["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in plugin_container(root)["volumeMounts"]}
    assert len(host) >= 8
    for name, path in host.items():
        if name != HOST_ROOT_VOLUME:
            assert mounts[name] == path, name
    assert host[HOST_ROOT_VOLUME] == "/"


def test_mounts_cover_every_directory_flag_default(root: list[Obj]) -> None:
    flags = flags_module()
    if flags is None:
        pytest.skip("deviceplugin/flags.py not there yet")
    defaults = {f.name: f.default for f in flags.RUN_FLAGS}
    pod_resources = defaults["--pod-resources-socket"] or flags.pod_resources_default(
        defaults["--kubelet-dir"]
    )
    wanted = {
        defaults["--kubelet-dir"],
        str(PurePosixPath(pod_resources).parent),  # the directory, so a re-created socket shows
        defaults["--state-dir"],
        defaults["--mps-root"],
        defaults["--cdi-dir"],
        defaults["--kubelet-plugins-dir"],
        defaults["--kubelet-registry-dir"],
    }
    mounts = {m["mountPath"]: m for m in plugin_container(root)["volumeMounts"]}
    assert wanted <= mounts.keys()
    assert mounts[str(PurePosixPath(pod_resources).parent)].get("readOnly") is True
    # `--sysfs-root` stays /sys: the container's own sysfs shows the cgroup version and NUMA.
    assert defaults["--sysfs-root"] == "/sys"
    port = int(defaults["--metrics-address"].rpartition(":")[2])
    ports = {p["name"]: p["containerPort"] for p in plugin_container(root)["ports"]}
    assert ports["metrics"] == port


def test_env_holds_only_flag_variables_node_name_and_nvidia(root: list[Obj]) -> None:
    env = plugin_container(root)["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names))
    node = next(e for e in env if e["name"] == "NODE_NAME")
    assert node["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    flags = flags_module()
    known = {f.env for f in flags.RUN_FLAGS} if flags else None
    for name in names:
        if name == "NODE_NAME" or name.startswith("NVIDIA_"):
            continue
        assert re.fullmatch(r"GPU_FRACTION_[A-Z_]+", name), name
        if known is not None:
            assert name in known, f"{name} is not a flag's variable"
    if known is not None:
        assert "GPU_FRACTION_SIMULATE" not in names


LAYOUTS = {"host-installed": (), "gpu-operator": ("gpu-operator",)}


def rendered_config(objects: list[Obj]) -> settings.Config:
    return settings.parse(yaml.safe_load(one(objects, "ConfigMap")["data"]["config.yaml"]))


def host_paths_named(cfg: settings.Config) -> dict[str, str]:
    """Every host path the config names, by its config path."""
    named = {"cdi.nvidiaCtkPath": cfg.cdi.nvidia_ctk_path, "cdi.driverRoot": cfg.cdi.driver_root}
    if cfg.mps.host_binary and cfg.mps.host_binary.startswith("/"):
        named["mps.hostBinary"] = cfg.mps.host_binary
    for i, spec_dir in enumerate(getattr(cfg.cdi, "spec_dirs", ())):  # cdi.specDirs, when known
        named[f"cdi.specDirs[{i}]"] = spec_dir
    return named


def container_view(objects: list[Obj], host_path: str) -> tuple[str, Obj] | None:
    """Where the container sees `host_path`: through the hostPath volume whose path is its
    longest prefix, mounted at mountPath + the rest; None when no volume holds it."""
    pod = plugin_ds(objects)["spec"]["template"]["spec"]
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    best: tuple[str, Obj] | None = None
    best_len = -1
    for mount in plugin_container(objects)["volumeMounts"]:
        source = volumes.get(mount["name"])
        if source is None:
            continue
        path, prefix = PurePosixPath(host_path), PurePosixPath(source)
        if (path == prefix or prefix in path.parents) and len(prefix.parts) > best_len:
            rest = path.relative_to(prefix)
            best = (str(PurePosixPath(mount["mountPath"]) / rest), mount)
            best_len = len(prefix.parts)
    return best


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_both_node_layouts_see_every_host_path_their_config_names(
    tmp_path: Path, layout: str
) -> None:
    """Host-installed driver and toolkit, and the GPU Operator's (/run/nvidia/driver,
    /usr/local/nvidia/toolkit): the pod must start on both, so no hostPath that may be absent
    is a File, and every host path the rendered config names is visible in the container,
    at that same path or under the host root the plugin reads through --host-root."""
    objects = render(overlay(tmp_path / layout, *LAYOUTS[layout]))
    pod = plugin_ds(objects)["spec"]["template"]["spec"]
    for volume in (v for v in pod["volumes"] if "hostPath" in v):
        kind = volume["hostPath"].get("type", "")
        # File/Socket/CharDevice fail the pod where the path is missing; "" lets the runtime
        # create a directory in its place (containerd does).
        assert kind in ("Directory", "DirectoryOrCreate"), (layout, volume)
    env = {e["name"]: e.get("value") for e in plugin_container(objects)["env"]}
    cfg = rendered_config(objects)
    for key, host_path in host_paths_named(cfg).items():
        assert host_path.startswith("/"), (layout, key)
        view = container_view(objects, host_path)
        assert view is not None, f"{layout}: {key}={host_path} is not mounted"
        inside, mount = view
        if mount["name"] == HOST_ROOT_VOLUME:
            assert inside == str(PurePosixPath(env["GPU_FRACTION_HOST_ROOT"]) / host_path[1:])
            # the driver container's mount appears after this pod starts
            assert mount.get("mountPropagation") == "HostToContainer", layout
            assert mount.get("readOnly") is True, layout
        else:
            assert inside == host_path, (layout, key)
    if layout == "gpu-operator":
        assert cfg.cdi.driver_root == "/run/nvidia/driver"
        assert cfg.cdi.nvidia_ctk_path == "/usr/local/nvidia/toolkit/nvidia-ctk"
        # the operator's driver container holds the control binary (its exact path follows
        # how the host-systemd unit uses the driver root)
        assert (cfg.mps.host_binary or "").endswith("/nvidia-cuda-mps-control")
        assert cfg.mps.launcher == settings.LAUNCHER_HOST_SYSTEMD
    else:
        assert cfg.cdi == settings.Config().cdi


def test_mps_root_propagates_and_static_cdi_specs_are_read_only(root: list[Obj]) -> None:
    mounts = {m["name"]: m for m in plugin_container(root)["volumeMounts"]}
    # the plugin mounts per-GPU shm tmpfs under the MPS root: they must reach the host
    assert mounts["mps-root"].get("mountPropagation") == "Bidirectional"
    static = next(m for m in mounts.values() if m["mountPath"] == "/etc/cdi")
    assert static.get("readOnly") is True
    assert mounts["cdi"]["mountPath"] == "/var/run/cdi" and not mounts["cdi"].get("readOnly")


def test_daemonset_runtime_settings(root: list[Obj]) -> None:
    ds = plugin_ds(root)
    pod = ds["spec"]["template"]["spec"]
    container = plugin_container(root)
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    assert pod["priorityClassName"] == "system-node-critical"
    assert container["securityContext"]["privileged"] is True
    # mps.launcher host-systemd enters PID 1's mount namespace: the host's PID namespace.
    assert pod["hostPID"] is True
    assert {"nvidia.com/gpu", "CriticalAddonsOnly"} <= {t["key"] for t in pod["tolerations"]}
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][kind].keys()
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["command"][0] == "gpu-fraction-plugin"
    assert container["command"][1] == "run"


def test_shipped_mps_launcher_matches_the_pod(root: list[Obj]) -> None:
    text = one(root, "ConfigMap")["data"]["config.yaml"]
    mps = settings.parse(yaml.safe_load(text)).mps
    pod = plugin_ds(root)["spec"]["template"]["spec"]
    assert mps.launcher == settings.LAUNCHER_HOST_SYSTEMD
    # nsenter -t 1 reaches the host's init only in the host PID namespace, and setns needs
    # the privileges of a privileged container.
    assert pod["hostPID"] is True
    assert plugin_container(root)["securityContext"]["privileged"] is True
    # The pipe dirs handed to the host's daemons are host paths.
    mounts = {m["name"]: m["mountPath"] for m in plugin_container(root)["volumeMounts"]}
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert mounts["mps-root"] == host["mps-root"]


def test_runtime_class_component(tmp_path: Path) -> None:
    objects = render(overlay(tmp_path / "rc", "nvidia-runtime-class"))
    assert plugin_ds(objects)["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"


def pod_specs(objects: list[Obj]) -> list[tuple[str, Obj, dict[str, str]]]:
    """(name, pod spec, annotations) for every Pod and pod template."""
    out: list[tuple[str, Obj, dict[str, str]]] = []
    for o in objects:
        if o["kind"] == "Pod":
            out.append((o["metadata"]["name"], o["spec"], o["metadata"].get("annotations", {})))
        elif "template" in o.get("spec", {}):
            t = o["spec"]["template"]
            out.append((o["metadata"]["name"], t["spec"], t["metadata"].get("annotations", {})))
    return out


def gpu_requests(spec: Obj) -> list[tuple[str, str, int]]:
    out = []
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        for kind in ("limits", "requests"):
            for name, value in c.get("resources", {}).get(kind, {}).items():
                if "nvidia.com" in name or "gpu" in name:
                    out.append((c["name"], name, int(value)))
    return out


def test_examples_use_the_default_resource_names(examples: list[Obj]) -> None:
    names = settings.ResourceNames()
    ours = {names.time_slicing, names.sm_sharing, names.exclusive}
    used = set()
    for pod_name, spec, _ in pod_specs(examples):
        requests = gpu_requests(spec)
        assert requests, f"{pod_name} requests no GPU resource"
        for _, resource, count in requests:
            assert resource in ours, f"{pod_name}: {resource}"
            assert count >= 1
            used.add(resource)
    assert used == ours, "one example per mode"


def test_ceiling_annotations_name_a_container_and_exceed_the_request(
    examples: list[Obj],
) -> None:
    pattern = re.compile(r"nvidia\.com/container\.([a-z0-9-]+)\.gpu-memory\.limit")
    slice_size = settings.Config().slice_size
    seen = 0
    for pod_name, spec, notes in pod_specs(examples):
        for key, value in notes.items():
            m = pattern.fullmatch(key)
            if m is None:
                continue
            seen += 1
            request = {c: n for c, _, n in gpu_requests(spec)}[m[1]] * slice_size
            assert parse_quantity(value) > request, pod_name
    assert seen >= 3  # the ceiling example and both pilot services


def test_init_container_example_shares_its_devices(examples: list[Obj]) -> None:
    spec = one(examples, "Pod", "fraction-init-container")["spec"]
    init = gpu_requests({"containers": spec["initContainers"]})
    app = gpu_requests({"containers": spec["containers"]})
    assert [r[1:] for r in init] == [r[1:] for r in app]


def test_pilot_is_two_services_on_one_resource(examples: list[Obj]) -> None:
    deployments = find(examples, "Deployment")
    assert len(deployments) == 2
    resources = {r[1] for d in deployments for r in gpu_requests(d["spec"]["template"]["spec"])}
    assert resources == {settings.ResourceNames().sm_sharing}
