"""The security docs match the code: every test they cite exists, and docs/rbac.md's
manifest is the base's RBAC (issue 33: the docs promised more than the code did)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from tests.kustomize_render import DAEMONSET, Obj, render_files

REPO = Path(__file__).resolve().parent.parent
DOCS = ["docs/threat-model.md", "docs/rbac.md", "docs/metrics.md", "README.md"]
CITED = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?")


def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_test_exists(doc: str) -> None:
    cited = CITED.findall((REPO / doc).read_text())
    if doc == "docs/threat-model.md":
        assert len(cited) >= 20  # the parties table names a test per claim
    for file, name in cited:
        path = REPO / file
        assert path.is_file(), f"{doc} cites {file}, which does not exist"
        if name:
            assert name in _defined(path), f"{doc} cites {file}::{name}, which is not defined"


def test_threat_model_names_every_party() -> None:
    text = (REPO / "docs/threat-model.md").read_text()
    table = text[text.index("## Parties") : text.index("## Tenants on one GPU")]
    rows = [line for line in table.splitlines() if line.startswith("| **")]
    parties = [row.split("**")[1] for row in rows]
    expected = [
        "Pod author",
        "Claim author",
        "Process in a container",
        "Network client",
        "Local unprivileged user",
        "The kubelet side",
        "Holder of the agent's token",
    ]
    for who in expected:
        assert who in parties, who
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 4 and cells[3], row  # who, can, cannot, shown by


def test_rbac_doc_manifest_is_the_base_rbac() -> None:
    text = (REPO / "docs/rbac.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    documented = [d for d in yaml.safe_load_all(block) if d]
    base = [o for o in render_files(DAEMONSET / "base")
            if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]  # fmt: skip

    def key(o: Obj) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    assert sorted(map(key, documented)) == sorted(map(key, base))
    by_key = {key(o): o for o in base}
    for doc in documented:
        real = by_key[key(doc)]
        assert doc["metadata"].get("namespace") == real["metadata"].get("namespace"), key(doc)
        for field in ("rules", "roleRef", "subjects"):
            assert doc.get(field) == real.get(field), (key(doc), field)
