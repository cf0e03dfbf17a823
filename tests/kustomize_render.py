"""Render `daemonset/` trees for the manifest and admission tests.

`render(path)` runs `kubectl kustomize` when kubectl is installed. Otherwise it assembles the
tree itself: the subset of kustomize the manifests use (`resources`, `components`, inline
JSON 6902 `patches` targeted by kind and name), so the tests run on a machine without kubectl.
A test compares the two renderings wherever both are available.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DAEMONSET = REPO / "daemonset"

Obj = dict[str, Any]


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(path: Path) -> list[Obj]:
    if kubectl() is not None:
        return render_kubectl(path)
    return render_files(path)


def render_kubectl(path: Path) -> list[Obj]:
    exe = kubectl()
    assert exe is not None
    out = subprocess.run(
        [exe, "kustomize", str(path)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def render_files(path: Path) -> list[Obj]:
    objects: list[Obj] = []
    _apply(path, objects)
    return objects


def _apply(path: Path, objects: list[Obj]) -> None:
    kustomization = yaml.safe_load((path / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "components", "patches"}
    unknown = set(kustomization) - known
    assert not unknown, f"{path}: fallback renderer does not support {sorted(unknown)}"
    for entry in kustomization.get("resources", []):
        target = path / entry
        if target.is_dir():
            _apply(target, objects)
        else:
            objects.extend(d for d in yaml.safe_load_all(target.read_text()) if d)
    for entry in kustomization.get("components", []):
        _apply(path / entry, objects)
    for patch in kustomization.get("patches", []):
        _patch(objects, patch)


def _patch(objects: list[Obj], patch: Obj) -> None:
    target = patch["target"]
    matches = [
        o
        for o in objects
        if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]
    ]
    assert matches, f"patch target {target} not found"
    for op in yaml.safe_load(patch["patch"]):
        for obj in matches:
            _json_patch(obj, op)


def _json_patch(obj: Obj, op: Obj) -> None:
    *parents, last = [
        p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")
    ]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    kind = op["op"]
    if kind in ("add", "replace"):
        value = copy.deepcopy(op["value"])
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(index, value)
            else:
                node[index] = value
        else:
            node[last] = value
    elif kind == "remove":
        del node[int(last) if isinstance(node, list) else last]
    else:
        raise AssertionError(f"fallback renderer does not support op {kind!r}")


def overlay(tmp: Path, *components: str) -> Path:
    """A throwaway kustomization of the base plus the named components (as a user writes one)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # kustomize accepts only relative paths for bases and components.
                "resources": [os.path.relpath(DAEMONSET / "base", tmp)],
                "components": [
                    os.path.relpath(DAEMONSET / "components" / c, tmp) for c in components
                ],
            }
        )
    )
    return tmp


def find(objects: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]
