"""The node agent's image (`make image`): what it is built from, and the image itself.

The first tests need no container engine: `--version`, the runtime closure the image installs
(no test or build tools), and the plugin's imports of the Kubernetes client (the image drops
the client's unused asyncio copy). The rest run the image `make image` built, as the DaemonSet
runs it (its command, env, privileges and every mount at the manifest's path, host paths
replaced by scratch dirs, simulated GPUs) against the kubelet simulator; they skip with one
line when the image is not built (it takes minutes; see README, "Building the image").
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import deviceplugin
from deviceplugin import cli
from deviceplugin.simulate.kubelet import KubeletSimulator
from tests.kustomize_render import DAEMONSET, one, render

REPO = Path(__file__).resolve().parent.parent
PODMAN = REPO / "hack" / "image" / "podman.sh"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
IMAGE = f"localhost/gpu-fraction-device-plugin:{VERSION}"
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1000:1000")
# The containers' (and conmon's) cgroups, in every hierarchy; removed when the tests end.
CGROUP_PARENT = "gpu-fraction-image-test"
RUN = ("--network=none", *ULIMITS, "--cgroup-parent", f"/{CGROUP_PARENT}")
# The one variable the test adds to the DaemonSet's: GPUs from the simulator, not NVML.
SIMULATED = {"GPU_FRACTION_SIMULATE": "h200x2"}


def wheels_module() -> Any:
    sys.path.insert(0, str(REPO / "hack" / "image"))
    try:
        import wheels

        return wheels
    finally:
        sys.path.pop(0)


def test_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"gpu-fraction-plugin {VERSION}\n"
    assert deviceplugin.__version__ == VERSION


def test_runtime_closure_is_the_dependencies_without_test_or_build_tools() -> None:
    closure = wheels_module().runtime_closure()
    declared = {
        canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]
    }
    assert declared <= set(closure)
    dev = {
        canonicalize_name(Requirement(r).name)
        for r in PYPROJECT["project"]["optional-dependencies"]["dev"]
    }
    tools = {"pip", "setuptools", "wheel", "pytest", "mypy", "ruff", "grpcio-tools", "cython"}
    leaked = (dev - declared | tools) & set(closure)
    assert not leaked, f"test or build tools in the image's closure: {sorted(leaked)}"
    for name, version in closure.items():
        assert version, name


def kubernetes_imports() -> set[str]:
    found = set()
    for path in (REPO / "deviceplugin").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found |= {n for n in names if n.split(".")[0] == "kubernetes"}
    return found


def test_the_plugin_never_imports_the_kubernetes_asyncio_client() -> None:
    """The Dockerfile removes kubernetes.aio from the image; nothing may need it."""
    imports = kubernetes_imports()
    assert imports, "the plugin uses the kubernetes client (deviceplugin/kube/client.py)"
    assert not [n for n in imports if n.startswith("kubernetes.aio")], imports


# ---- the built image ------------------------------------------------------------------------


def why_no_image() -> str | None:
    if os.geteuid() != 0:
        return "needs root (rootful podman)"
    for tool in ("podman", "runc", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} not found (`make image-deps`)"
    out = subprocess.run([str(PODMAN), "image", "exists", IMAGE], capture_output=True, timeout=60)
    if out.returncode != 0:
        return f"{IMAGE} not built; `make image` builds it (minutes)"
    return None


class Engine:
    """hack/image/podman.sh inside one held mount namespace, so calls share podman's run root."""

    def __init__(self) -> None:
        self.holder = subprocess.Popen(
            [str(PODMAN), "--hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.holder.stdout is not None
        assert self.holder.stdout.readline().strip() == "ready"

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", "--"]
        argv += ["env", "GPUFRAC_IMAGE_NS=1", str(PODMAN), *args]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if check and out.returncode != 0:
            raise AssertionError(f"podman {args[:2]}: rc={out.returncode} {out.stderr[-2000:]}")
        return out

    def close(self) -> None:
        assert self.holder.stdin is not None
        self.holder.stdin.close()
        self.holder.wait(30)
        for top in Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}"):
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True):
                d.rmdir()
            top.rmdir()


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    why = why_no_image()
    if why is not None:
        pytest.skip(f"image tests: {why}")
    eng = Engine()
    try:
        labels = json.loads(eng("image", "inspect", "--format", "{{json .Labels}}", IMAGE).stdout)
        assert labels.get("org.opencontainers.image.version") == VERSION, labels
        yield eng
    finally:
        eng.close()


def sh(engine: Engine, script: str) -> str:
    out = engine("run", "--rm", *RUN, "--entrypoint", "sh", IMAGE, "-c", script)
    return out.stdout


def test_image_prints_its_version(engine: Engine) -> None:
    out = engine("run", "--rm", *RUN, IMAGE, "--version")
    assert out.stdout == f"gpu-fraction-plugin {VERSION}\n"


def test_image_holds_the_runtime_only(engine: Engine) -> None:
    out = sh(
        engine,
        "for t in gcc cc g++ make pip pip3 apt-get nvidia-smi gpu-fraction-plugin nsenter"
        " unshare mount sh; do printf '%s=%s\\n' $t \"$(command -v $t)\"; done;"
        " for m in pytest setuptools pip kubernetes.aio hypothesis; do"
        '   python3 -c "import $m" 2>/dev/null && echo import:$m; done;'
        " ls /usr/lib/x86_64-linux-gnu | grep -c nvidia-ml || true",
    )
    found = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    for tool in ("gcc", "cc", "g++", "make", "pip", "pip3", "apt-get", "nvidia-smi"):
        assert found[tool] == "", f"{tool} in the image: {found[tool]}"
    for tool in ("gpu-fraction-plugin", "nsenter", "unshare", "mount", "sh"):
        assert found[tool], f"{tool} missing from the image"
    assert not [line for line in out.splitlines() if line.startswith("import:")], out
    assert out.splitlines()[-1] == "0", "NVML comes from the host's driver, not the image"
    user = engine("image", "inspect", "--format", "{{.Config.User}}", IMAGE).stdout.strip()
    assert user in ("", "root", "0"), user


def daemonset_run_args(tmp: Path) -> tuple[list[str], list[str], Path]:
    """podman arguments for the base DaemonSet's plugin container: privileges, env, every
    volume at its mountPath (host paths under `tmp` but /dev, the ConfigMap's files written
    out), the command; and the host dir behind /var/lib/kubelet/device-plugins."""
    objects = render(DAEMONSET / "base")
    pod = one(objects, "DaemonSet", "gpu-fraction-plugin")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "plugin"]
    args: list[str] = []
    if container.get("securityContext", {}).get("privileged"):
        args.append("--privileged")
    for var in container.get("env", []):
        value = var.get("value")
        if value is None:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", var
            value = "image-test-node"
        args += ["-e", f"{var['name']}={value}"]
    for name, value in SIMULATED.items():
        args += ["-e", f"{name}={value}"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    kubelet_dir = None
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        source = tmp / "host" / mount["name"]
        source.mkdir(parents=True)
        if volume.get("hostPath", {}).get("path") == "/dev":
            source = Path("/dev")  # the runtime needs a real /dev there (/dev/null, ...)
        elif "configMap" in volume:
            cm = one(objects, "ConfigMap", volume["configMap"]["name"])
            for key, text in cm["data"].items():
                (source / key).write_text(text)
        else:
            assert "hostPath" in volume, volume
        if mount["mountPath"] == "/var/lib/kubelet/device-plugins":
            kubelet_dir = source
        mode = "ro" if mount.get("readOnly") else "rw"
        args += ["-v", f"{source}:{mount['mountPath']}:{mode}"]
    assert kubelet_dir is not None
    return args, list(container["command"]), kubelet_dir


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """Unix socket paths must stay under 108 bytes; pytest's tmp_path is too deep."""
    path = Path(tempfile.mkdtemp(prefix="gfi-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_image_runs_as_the_daemonset_does(engine: Engine, short_tmp: Path) -> None:
    args, command, kubelet_dir = daemonset_run_args(short_tmp)
    kubelet = KubeletSimulator(kubelet_dir)
    kubelet.start()
    name = f"gf-image-test-{os.getpid()}"
    try:
        engine(
            "run", "-d", "--name", name, *RUN, *args,
            "--entrypoint", json.dumps(command), IMAGE,
        )  # fmt: skip
        registered = kubelet.wait_for(lambda: len(kubelet.resources()) >= 1, timeout=60)
        logs = engine("logs", name, check=False)
        assert registered, f"no registration with the kubelet: {logs.stdout}{logs.stderr}"
        probe = (
            "import sys, urllib.request as u\n"
            "for path in ('/healthz', '/readyz'):\n"
            "    print(path, u.urlopen('http://127.0.0.1:9447' + path, timeout=5).status)\n"
        )
        deadline = time.monotonic() + 30
        while True:
            out = engine("exec", name, "python3", "-c", probe, check=False)
            if out.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert out.stdout.split() == ["/healthz", "200", "/readyz", "200"], out.stderr[-2000:]
        assert "nvidia.com/gpu-fraction" in kubelet.resources()
        engine("stop", "--time", "20", name)
        state = engine("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        logs = engine("logs", name, check=False)
        assert state == "0", f"exit {state} after SIGTERM: {logs.stderr[-2000:]}"
        assert "Traceback" not in logs.stdout + logs.stderr
    finally:
        engine("rm", "-f", name, check=False)
        kubelet.stop()
