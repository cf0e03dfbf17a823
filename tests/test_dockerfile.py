"""The container image recipe, checked without a container engine: every stage on the base
`make image` bootstraps from Debian's packages (no registry image), a venv filled from wheels
only whose entrypoint is a real console script, and a build context (after `.dockerignore`) that
is exactly the wheelhouse hack/image/wheels.py writes. tests/test_image.py runs the built image.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
# The base hack/image/build.sh imports (its tag gains a hash of the recipe: --build-arg BASE).
BASE_IMAGE = "localhost/gpu-fraction/base"
WHEELHOUSE = "build/image/wheels"  # what hack/image/build.sh passes hack/image/wheels.py


def wheels_module() -> Any:
    sys.path.insert(0, str(REPO / "hack" / "image"))
    try:
        import wheels

        return wheels
    finally:
        sys.path.pop(0)


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "dangling line continuation"
    return out


def ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """(.dockerignore) → (negated, regex) in file order."""
    out = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        out.append((negate, re.compile(regex)))
    return out


def in_context(rel: str) -> bool:
    """Docker's rule: the last pattern matching the path or any parent of it decides."""
    parts = rel.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for negate, regex in ignore_patterns():
        if any(regex.fullmatch(c) for c in candidates):
            included = negate
    return included


def test_stages_use_the_bootstrapped_base_and_no_registry_image() -> None:
    steps = instructions()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for w, a in steps if w == "ARG" and "=" in a}
    assert args["BASE"].startswith(BASE_IMAGE + ":"), args
    build = (REPO / "hack" / "image" / "build.sh").read_text()
    assert f"BASE={BASE_IMAGE}:" in build and "--build-arg BASE=" in build
    froms = [a for w, a in steps if w == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    stages: set[str] = set()
    for arg in froms:
        image, *rest = arg.split()
        assert image == "${BASE}" or image in stages, f"FROM {image}: not the base nor a stage"
        if rest:
            assert rest[0].upper() == "AS"
            stages.add(rest[1])
    assert froms[-1].split()[0] == "${BASE}", "the run stage starts from the bare base"


def test_entrypoint_is_a_console_script_of_the_package() -> None:
    entry = [args for word, args in instructions() if word == "ENTRYPOINT"]
    assert len(entry) == 1
    argv = json.loads(entry[0])  # exec form, so signals reach the plugin
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv[0] in scripts
    module, _, func = scripts[argv[0]].partition(":")
    assert callable(getattr(importlib.import_module(module), func))
    cmd = json.loads(next(a for w, a in instructions() if w == "CMD"))
    assert cmd == ["run"]


def test_run_stage_path_reaches_the_venv_and_the_app_the_build_stages_made() -> None:
    steps = instructions()
    runs = " ".join(a for w, a in steps if w == "RUN")
    venv = re.search(r"-m venv --without-pip (\S+)", runs)
    app = re.search(r"--target (\S+)", runs)
    assert venv is not None and app is not None
    pth = re.search(r"echo (\S+) > \S+\.pth", runs)
    assert pth is not None and pth[1] == app[1], "the .pth puts the app on the venv's path"
    copies = [a.split()[1:] for w, a in steps if w == "COPY" and a.startswith("--from=")]
    assert [venv[1], venv[1]] in copies and [app[1], app[1]] in copies
    env = " ".join(a for w, a in steps if w == "ENV")
    assert f"PATH={app[1]}/bin:{venv[1]}/bin:" in env
    assert not any(w == "USER" for w, _ in steps)  # root by necessity; the comment says why
    assert "--no-index" in runs or "PIP_NO_INDEX=1" in env
    assert "--only-binary=:all:" in runs


def test_copied_sources_are_the_wheelhouse_and_survive_dockerignore() -> None:
    sources = []
    for word, args in instructions():
        if word != "COPY" or args.startswith("--from="):
            continue
        *srcs, _dest = args.split()
        sources += srcs
    assert sorted(sources) == [f"{WHEELHOUSE}/{d}/" for d in ("app", "deps", "tools")]
    for d in ("app", "deps", "tools"):
        assert in_context(f"{WHEELHOUSE}/{d}/x-1.0-py3-none-any.whl")
    assert in_context(f"{WHEELHOUSE}/deps/requirements.txt")
    # The sources reach the image only inside the app's wheel.
    assert not in_context("deviceplugin/cli.py")
    assert not in_context("tests/test_dockerfile.py")
    assert not in_context("build/lib/deviceplugin/cli.py")
    assert not in_context(".venv/bin/python")


def test_wheels_writes_what_the_dockerfile_copies(tmp_path: Path) -> None:
    """The project's wheel, byte-identical when built twice (so podman reuses its layer), with
    the entrypoint and the generated modules."""
    wheels = wheels_module()
    first = wheels.build_app(tmp_path / "a")
    second = wheels.build_app(tmp_path / "b")
    assert first.name == second.name
    assert first.read_bytes() == second.read_bytes(), "the app wheel is not reproducible"
    with zipfile.ZipFile(first) as zf:
        names = zf.namelist()
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        text = zf.read(entry_points).decode()
    assert "gpu-fraction-plugin = deviceplugin.cli:main" in text
    assert "deviceplugin/_pb/deviceplugin_v1beta1_pb2.py" in names
    assert "deviceplugin/py.typed" in names
    assert not [n for n in names if "__pycache__" in n or n.startswith("tests/")]


@pytest.mark.soak
def test_pip_install_into_a_fresh_venv(tmp_path: Path) -> None:
    """What the image's stages do: a fresh venv, the app's wheel and its pinned wheels."""
    wheels = wheels_module()
    assert wheels.main(tmp_path / "wheels") == 0
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--no-index", "--only-binary=:all:"]
    deps = tmp_path / "wheels" / "deps"
    subprocess.run(
        [*pip, "--find-links", str(deps), "-r", str(deps / "requirements.txt")],
        check=True,
        timeout=900,
    )
    (app,) = (tmp_path / "wheels" / "app").glob("*.whl")
    subprocess.run([*pip, "--no-deps", str(app)], check=True, timeout=300)
    script = venv / "bin" / "gpu-fraction-plugin"
    assert script.exists()
    subprocess.run([str(venv / "bin" / "python"), "-c", "import deviceplugin.cli"], check=True)
