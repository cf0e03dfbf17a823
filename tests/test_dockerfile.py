"""The container image recipe, checked without a container engine: pinned bases, a multi-stage
venv install whose entrypoint is a real console script, and a build context (after
`.dockerignore`) from which the package really builds and installs.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
BASE_IMAGE = "python:3.11-slim-bookworm"


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


def build_context(dest: Path) -> Path:
    """Copy what `docker build .` would send."""
    for path in sorted(REPO.rglob("*")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith((".git/", ".venv/")) or rel in (".git", ".venv"):
            continue
        if path.is_file() and in_context(rel):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    return dest


def test_stages_use_the_pinned_python_base() -> None:
    froms = [args for word, args in instructions() if word == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    for args in froms:
        image = args.split()[0]
        assert image == BASE_IMAGE, image
    assert re.fullmatch(rf"{re.escape(BASE_IMAGE)} AS \w+", froms[0], re.IGNORECASE)


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


def test_run_stage_path_reaches_the_venv_the_build_stage_made() -> None:
    steps = instructions()
    venv = re.search(r"-m venv (\S+)", next(a for w, a in steps if w == "RUN"))
    assert venv is not None
    copies = [a for w, a in steps if w == "COPY" and a.startswith("--from=")]
    assert any(a.split()[1:] == [venv[1], venv[1]] for a in copies)
    env = " ".join(a for w, a in steps if w == "ENV")
    assert f"PATH={venv[1]}/bin:" in env
    assert not any(w == "USER" for w, _ in steps)  # root by necessity; the comment says why


def test_copied_sources_survive_dockerignore() -> None:
    for word, args in instructions():
        if word != "COPY" or args.startswith("--from="):
            continue
        *sources, _dest = args.split()
        for source in sources:
            matches = list(REPO.glob(source))
            if not source.endswith("*"):
                assert matches, f"COPY {source}: not in the repository"
            for m in matches:
                assert in_context(m.relative_to(REPO).as_posix()), source
    assert in_context("deviceplugin/_pb/deviceplugin_v1beta1_pb2.py")
    assert not in_context("tests/test_dockerfile.py")
    assert not in_context("deviceplugin/__pycache__/cli.cpython-311.pyc")


def test_the_context_builds_a_wheel_with_the_entrypoint(tmp_path: Path) -> None:
    context = build_context(tmp_path / "ctx")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*pip, "-w", str(tmp_path / "dist"), str(context)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        text = zf.read(entry_points).decode()
    assert "gpu-fraction-plugin = deviceplugin.cli:main" in text
    assert "deviceplugin/_pb/deviceplugin_v1beta1_pb2.py" in names
    assert "deviceplugin/py.typed" in names


@pytest.mark.soak
def test_pip_install_into_a_fresh_venv(tmp_path: Path) -> None:
    """What the image's build stage does: a fresh venv, `pip install .` from the context."""
    context = build_context(tmp_path / "ctx")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-compile", str(context)],
        check=True,
        timeout=900,
    )
    script = venv / "bin" / "gpu-fraction-plugin"
    assert script.exists()
    subprocess.run([str(venv / "bin" / "python"), "-c", "import deviceplugin.cli"], check=True)
