"""The Helm chart (daemonset/chart/): it lints, every documented values example renders objects
that validate against the Kubernetes 1.36 and 1.37 schemas and a config the plugin accepts, bad
values are refused with a message naming them, and for each kustomize component the chart with
the matching values renders the same objects as the kustomize tree (normalised: Helm's own
labels dropped, the config compared as parsed YAML).

Needs `helm` built from its Go module (`make helm`, which `make test` runs first); skips with
one line when it is not there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deviceplugin.config import settings
from tests.kustomize_render import DAEMONSET, Obj, overlay, render

REPO = Path(__file__).resolve().parent.parent
CHART = DAEMONSET / "chart"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
NAMESPACE = "gpu-fraction-system"
K8S_VERSIONS = ("1.36.0", "1.37.0")
# Objects whose kinds the Kubernetes schemas do not hold (a CRD's), checked by hand below.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
HELM_LABELS = ("app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "helm.sh/chart")


@pytest.fixture(scope="module")
def helm() -> Iterator[str]:
    out = subprocess.run(
        [str(REPO / "hack" / "helm.sh"), "--print"], capture_output=True, text=True, timeout=60
    )
    path = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout else ""
    if not path or not Path(path).is_file():
        pytest.skip(f"chart tests: helm not built; `make helm` builds it ({out.stderr.strip()})")
    yield path


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def template(helm: str, *args: str, kube: str = "1.37.0") -> list[Obj]:
    out = run_helm(
        helm, "template", "gpu-fraction", str(CHART), "-n", NAMESPACE, "--kube-version", kube, *args
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_lint_with_defaults_and_every_example(helm: str) -> None:
    for values in [None, *EXAMPLES]:
        extra = ["-f", str(values)] if values else []
        out = run_helm(helm, "lint", "--strict", str(CHART), *extra)
        assert out.returncode == 0, f"{values}: {out.stdout}{out.stderr}"


def test_examples_are_documented() -> None:
    assert {p.name for p in EXAMPLES} >= {"dra.yaml", "gpu-operator.yaml", "metrics.yaml"}
    readme = (REPO / "README.md").read_text()
    assert "daemonset/chart/examples/" in readme
    for path in EXAMPLES:
        assert path.read_text().startswith("# "), f"{path.name}: say what it is for"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_example_validates_against_kubernetes_schemas(helm: str, version: str) -> None:
    checked = 0
    for values in [None, *EXAMPLES]:
        extra = ["-f", str(values)] if values else []
        for obj in template(helm, *extra, kube=version):
            name = (
                f"{values.name if values else 'defaults'}: {obj['kind']}/{obj['metadata']['name']}"
            )
            if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
                assert obj["spec"]["endpoints"][0]["port"] == "metrics", name
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{name}: {err.message}")
            checked += 1
    assert checked >= 40


def config_of(objects: list[Obj]) -> Any:
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap"]
    return yaml.safe_load(cm["data"]["config.yaml"])


def test_every_example_renders_a_config_the_plugin_accepts(helm: str) -> None:
    for values in [None, *EXAMPLES]:
        extra = ["-f", str(values)] if values else []
        data = config_of(template(helm, *extra))
        try:
            settings.parse(data)
        except settings.ConfigError as err:
            pytest.fail(f"{values}: {err.problems}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "api=grpc"], "at '/api': value must be one of 'device-plugin', 'dra'"),
        (["--set", "config.sliceSiz=1Gi"], "additional properties 'sliceSiz' not allowed"),
        (["--set", "config.mps.launcher=1"], "at '/config/mps/launcher'"),
        (["--set", "image.pullPolicy=Sometimes"], "at '/image/pullPolicy'"),
        (["--set", "gpus[0].mode=shared"], "at '/gpus/0"),
        (["--set", "maxUnavailable=0"], "at '/maxUnavailable'"),
        (["--set", "metrics.port=70000"], "at '/metrics/port'"),
        (["--set", "admissionPolicy.resources[0]=gpu"], "at '/admissionPolicy/resources/0'"),
        (["--set", "metrics.serviceMonitor.enabled=true"], "needs metrics.service.enabled"),
        (["--set", "extraEnv[0].value=x"], "at '/extraEnv/0': missing property 'name'"),
        (["--set-json", "metrics.networkPolicy.from=[]"], "at '/metrics/networkPolicy/from'"),
    ],
)
def test_bad_values_are_refused_naming_the_value(helm: str, args: list[str], message: str) -> None:
    out = run_helm(helm, "template", "x", str(CHART), *args)
    assert out.returncode != 0, f"{args} accepted"
    assert message in out.stderr, out.stderr


def test_extra_env_follows_the_charts_own(helm: str) -> None:
    extra = [{"name": "GPU_FRACTION_SIMULATE", "value": "h200x2"}]
    (ds,) = [o for o in template(helm, "--set-json", f"extraEnv={json.dumps(extra)}")
             if o["kind"] == "DaemonSet"]  # fmt: skip
    env = ds["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env[-1] == extra[0], env
    assert [e["name"] for e in env].count("GPU_FRACTION_CONFIG") == 1


def test_notes_say_how_to_check_the_install(helm: str) -> None:
    out = run_helm(
        helm, "install", "gpu-fraction", str(CHART), "-n", NAMESPACE, "--dry-run=client",
        "-f", str(CHART / "examples" / "dra.yaml"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} rollout status daemonset/gpu-fraction-plugin" in notes
    assert "pod-security.kubernetes.io/enforce=privileged" in notes
    assert f"kubectl label namespace {NAMESPACE} gpu-fraction.dev/admission=skip" in notes
    assert "kubectl get deviceclasses" in notes  # DRA on: its checks too
    assert "docs/upgrade.md" in notes


def normalise(objects: list[Obj]) -> dict[tuple[str, str], Obj]:
    out = {}
    for obj in objects:
        obj = yaml.safe_load(yaml.safe_dump(obj))  # a copy
        for meta in (obj["metadata"], obj.get("spec", {}).get("template", {}).get("metadata")):
            if meta and "labels" in meta:
                for label in HELM_LABELS:
                    meta["labels"].pop(label, None)
        if obj["kind"] == "ConfigMap":
            obj["data"] = {k: yaml.safe_load(v) for k, v in obj["data"].items()}
        out[(obj["kind"], obj["metadata"]["name"])] = obj
    return out


# Chart values ≡ the kustomize tree they stand for (the base plus these components).
EQUIVALENT = {
    "defaults": ([], ("admission-policy",)),
    "api=dra": (["--set", "api=dra"], ("admission-policy", "dra")),
    "gpuOperator": (["--set", "gpuOperator=true"], ("admission-policy", "gpu-operator")),
    "runtimeClass": (
        ["--set", "runtimeClassName=nvidia"],
        ("admission-policy", "nvidia-runtime-class"),
    ),
    "no admission policy": (["--set", "admissionPolicy.enabled=false"], ()),
    "wholeGpus": (
        ["--set", "admissionPolicy.wholeGpus=true"],
        ("admission-policy", "admission-policy-whole-gpus"),
    ),
}


@pytest.mark.parametrize("case", list(EQUIVALENT))
def test_chart_renders_what_kustomize_renders(helm: str, tmp_path: Path, case: str) -> None:
    args, components = EQUIVALENT[case]
    chart = normalise(template(helm, "--set", "namespace.create=true", *args))
    kustomize = normalise(render(overlay(tmp_path / "k", *components)))
    assert sorted(chart) == sorted(kustomize), case
    for key, obj in kustomize.items():
        assert chart[key] == obj, f"{case}: {key} differs"


def test_default_chart_matches_the_default_install(helm: str) -> None:
    """`helm install` with no values ≡ `kubectl apply -k daemonset/` (but the Namespace,
    which Helm leaves to the operator unless namespace.create)."""
    chart = normalise(template(helm))
    kustomize = normalise(render(DAEMONSET))
    kustomize.pop(("Namespace", NAMESPACE))
    assert chart == kustomize


def test_values_docs_are_current() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "hack" / "gen-chart-docs.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
