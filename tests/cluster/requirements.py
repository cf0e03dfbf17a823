"""Why the cluster suite cannot run here, or nothing: `python -m tests.cluster.requirements`.

Prints one line and exits 1 when something is missing (not root, a component not built, a
cluster already up), 0 when the suite can run. `make test-cluster` and the suite's own
fixture ask it, so a skip always says why; `.ci/run` fails a skipped suite under CI=true.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "hack" / "cluster"
VERSIONS = ("1.37.2", "1.36.3")


def version() -> str:
    """The Kubernetes release this run judges: GPUFRAC_K8S, default the newest we build."""
    return os.environ.get("GPUFRAC_K8S", VERSIONS[0])


def missing(release: str | None = None) -> str | None:
    release = release or version()
    if release not in VERSIONS:
        return f"Kubernetes {release} is not one of the releases built here ({', '.join(VERSIONS)})"
    if os.geteuid() != 0:
        return "needs root (namespaces, mounts, cgroups)"
    for tool in ("nsenter", "unshare", "ip", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} not found (make cluster-deps)"
    for component in (f"kubernetes-{release}", "etcd", "containerd", "runc"):
        out = subprocess.run(
            [str(CLUSTER / "deps.sh"), "--print-dir", component], capture_output=True, text=True
        )
        bin_dir = Path(out.stdout.strip()) / "bin"
        if out.returncode != 0 or not bin_dir.is_dir():
            return f"{component} not built (make cluster-deps)"
    return None


if __name__ == "__main__":
    why = missing(sys.argv[1] if len(sys.argv) > 1 else None)
    if why is not None:
        print(why)
        sys.exit(1)
