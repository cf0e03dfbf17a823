"""The image's wheelhouse: the project's wheel and its runtime dependencies, as wheels only.

    python hack/image/wheels.py OUT_DIR

Writes OUT_DIR/app/ (the project's wheel, built from a clean copy of what the image needs,
with a fixed timestamp so an unchanged tree gives a byte-identical wheel and podman reuses the
layer) and OUT_DIR/deps/ (every runtime dependency, pinned to the version this venv has, so the
image runs what the tests ran; `--only-binary=:all:` so no compiler is ever needed) with
OUT_DIR/deps/requirements.txt, and the pip wheel the image's build stage runs pip from.
Run with the project's venv (`make image` does); it needs PyPI only for wheels not yet there.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
# What the image's Python is: Debian bookworm's python3 (hack/image/build.sh, SUITE).
TARGET_PYTHON = "3.11"
# The glibc of Debian bookworm (2.36): any manylinux wheel up to it runs there.
GLIBC_MINOR = 36
# 1980-01-01, the earliest a zip entry can say: the wheel's bytes depend only on its files.
SOURCE_DATE_EPOCH = "315532800"
SOURCES = ("pyproject.toml", "README.md", "deviceplugin")


def runtime_closure() -> dict[str, str]:
    """name → installed version for every runtime dependency, transitively, no extras; the
    markers evaluated for the image's Python on Linux."""
    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    env.update(python_version=TARGET_PYTHON, python_full_version=f"{TARGET_PYTHON}.0")
    env.update(sys_platform="linux", platform_system="Linux")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    pins: dict[str, str] = {}
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in pins:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            sys.exit(f"wheels: {req.name} is not installed in {sys.prefix}; run `make .venv`")
        if not req.specifier.contains(dist.version, prereleases=True):
            sys.exit(f"wheels: installed {req.name} {dist.version} does not satisfy {req}")
        pins[name] = dist.version
        todo.extend(Requirement(r) for r in dist.requires or [])
    return dict(sorted(pins.items()))


def platforms() -> list[str]:
    arch = platform.machine()
    tags = [f"manylinux_2_{m}_{arch}" for m in range(GLIBC_MINOR, 16, -1)]
    return [*tags, f"manylinux2014_{arch}", f"linux_{arch}"]


def download(requirements: Path, dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    cmd += ["--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation", "cp"]
    cmd += [arg for p in platforms() for arg in ("--platform", p)]
    subprocess.run([*cmd, "-d", str(dest), "-r", str(requirements)], check=True)


def build_app(dest: Path) -> Path:
    """The project's wheel from a fresh copy of its sources (a stale setuptools build/ dir in
    the tree would carry deleted modules into the wheel)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in SOURCES:
            path = REPO / name
            if path.is_dir():
                ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
                shutil.copytree(path, src / name, ignore=ignore)
            else:
                shutil.copy2(path, src / name)
        out = Path(tmp) / "dist"
        cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
        cmd += ["--no-build-isolation", "-w", str(out), str(src)]
        env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        (wheel,) = out.glob("*.whl")
        target = dest / wheel.name
        if target.exists() and target.read_bytes() == wheel.read_bytes():
            return target  # untouched, mtime and all: the image's COPY layer stays cached
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        return Path(shutil.copy2(wheel, target))


def main(out: Path) -> int:
    deps = out / "deps"
    deps.mkdir(parents=True, exist_ok=True)
    pins = runtime_closure()
    lines = [f"{name}=={version}" for name, version in pins.items()]
    requirements = deps / "requirements.txt"
    text = "\n".join(lines) + "\n"
    if not requirements.exists() or requirements.read_text() != text:
        requirements.write_text(text)  # unchanged pins keep the file, so podman's COPY cache
    have = set()
    for wheel in deps.glob("*.whl"):  # a wheel no longer pinned would linger in the layer
        name, version = wheel.name.split("-")[:2]
        if pins.get(canonicalize_name(name)) == version:
            have.add(canonicalize_name(name))
        else:
            wheel.unlink()
    if have != set(pins):  # asks PyPI only for what is missing
        download(requirements, deps)
    tools = out / "tools"
    tools.mkdir(exist_ok=True)
    pip = md.version("pip")
    if not list(tools.glob(f"pip-{pip}-*.whl")):
        for old in tools.glob("pip-*.whl"):
            old.unlink()
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--only-binary=:all:", "-d", str(tools), f"pip=={pip}"],
            check=True,
        )  # fmt: skip
    app = build_app(out / "app")
    print(f"wheels: {len(pins)} dependencies, {app.name}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
