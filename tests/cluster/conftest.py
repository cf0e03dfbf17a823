"""The cluster suite's session: a real single node (`hack/cluster/up.sh`), the real plugin
on it, and at the end proof that `down.sh` left the host as it was.

The release comes from `GPUFRAC_K8S` (default 1.37.2; `make test-cluster` runs 1.37.2 and
then 1.36.3). Skipped with the reason where `tests.cluster.requirements` says the host cannot
run it; prints `cluster suite (Kubernetes X): N passed, ...` (`.ci/run` requires it under
CI=true).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.agent import Agent, serving_agent
from tests.cluster.kube import Cluster, Obj, wait_for
from tests.cluster.requirements import CLUSTER, missing, version

BUSYBOX = "localhost/gpu-fraction/busybox:1"
# The image the shipped examples name: our busybox, tagged so, so the examples apply unchanged
# (their default pull policy, IfNotPresent, finds it and pulls nothing).
EXAMPLE_IMAGE = "docker.io/nvidia/cuda:12.4.1-base-ubuntu22.04"


def host_state() -> str:
    """What cluster-down must restore, less the host's process list: other work runs beside
    the suite, and down.sh itself checks that no process of the cluster's remains."""
    out = subprocess.run(
        [str(CLUSTER / "host-state.sh")], capture_output=True, text=True, check=True
    ).stdout
    sections = {}
    for block in out.split("# ")[1:]:
        name, _, body = block.partition("\n")
        sections[name.strip()] = body
    # namespaces, processes and other services' cgroups: other work on the host comes and goes;
    # down.sh checks that no process of the cluster's remains, and a namespace ends with its
    # last process.
    sections["cgroups"] = "".join(
        line + "\n" for line in sections.get("cgroups", "").splitlines() if "gpu-fraction" in line
    )
    return "".join(
        f"# {k}\n{v}" for k, v in sections.items() if k not in ("namespaces", "processes")
    )


# One node per host at a time (its cgroup parent and run dir are fixed): a second run of the
# suite waits here for the first to finish.
LOCK = Path("/tmp/gpu-fraction-cluster.lock")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    why = missing()
    if why is not None:
        pytest.skip(f"cluster suite: {why}")
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _cluster()


def _cluster() -> Iterator[Cluster]:
    run = Path(os.environ.get("GPUFRAC_CLUSTER_RUN", "/tmp/gpu-fraction-cluster"))
    if run.exists():  # a cluster someone started by hand, or one a killed run left behind
        raise AssertionError(f"{run} exists: a cluster is up or left behind (make cluster-down)")
    before = host_state()
    c = Cluster.up(version())
    CLUSTERS.append(c)
    try:
        ctr = subprocess.run(
            [str(CLUSTER / "deps.sh"), "--print-dir", "containerd"], capture_output=True,
            text=True, check=True,
        ).stdout.strip()  # fmt: skip
        c.sh(f'"{ctr}/bin/ctr" --address /run/containerd/containerd.sock -n k8s.io images tag '
             f"--force {BUSYBOX} {EXAMPLE_IMAGE} >/dev/null")  # fmt: skip
        wait_for(lambda: c.kubectl("get", "sa", "default", check=False).returncode == 0, 60,
                 "the default ServiceAccount")  # fmt: skip
        yield c
    finally:
        CLUSTERS.remove(c)
        c.down()
    after = host_state()
    assert after == before, "cluster-down left the host changed:\n" + _diff(before, after)


def _diff(a: str, b: str) -> str:
    import difflib

    return "\n".join(difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0))


# The shipped admission policies refused one of the agent's own writes (docs/rbac.md): a
# policy narrower than the code, which no single test may notice (records, labels and events
# are best effort).
REFUSED_BY_OUR_POLICY = re.compile(r"ValidatingAdmissionPolicy\W{0,3}gpu-fraction-[\w-]+")


@pytest.fixture(scope="session")
def agent(cluster: Cluster) -> Iterator[Agent]:
    with serving_agent(cluster) as a:
        AGENTS.append(a)
        try:
            yield a
        finally:
            AGENTS.remove(a)
        refused = REFUSED_BY_OUR_POLICY.findall(a.log.read_text(errors="replace"))
        assert not refused, f"the shipped policies refused the agent's own writes: {refused}"


AGENTS: list[Agent] = []  # the running agent, whose log a failed test's report shows
CLUSTERS: list[Cluster] = []  # the cluster up, whose kubelet's errors a failed test shows


def kubelet_complaints(cluster: Cluster, lines: int = 60) -> str:
    """The kubelet's last error and warning lines (klog `E`/`W`): its log goes with the run
    dir at cluster-down, and it alone says why a pod did not start."""
    try:
        text = (cluster.run / "logs" / "kubelet.log").read_text(errors="replace")
    except OSError as err:
        return f"(no kubelet log: {err})"
    picked = [line for line in text.splitlines() if line[:1] in ("E", "W")]
    return "\n".join(line[:600] for line in picked[-lines:])


def pods_and_events(cluster: Cluster, lines: int = 40) -> str:
    """Each pod's phase and its containers' states, the last events and containerd's last
    errors: which pod did not start, and what the kubelet and the runtime said of it."""
    out: list[str] = []
    try:
        listed = cluster.kubectl("get", "pods", "-A", "-o", "json", check=False, timeout=20)
        for p in json.loads(listed.stdout or "{}").get("items", []):
            meta, status = p["metadata"], p.get("status", {})
            out.append(f"{meta['namespace']}/{meta['name']} {status.get('phase')} "
                       f"{status.get('reason', '')}")  # fmt: skip
            for c in status.get("containerStatuses") or []:
                now, last = c.get("state", {}), c.get("lastState", {})
                out.append(f"  {c['name']} {c.get('containerID', '')[:25]} restarts="
                           f"{c.get('restartCount')} state={now} last={last}")  # fmt: skip
        events = cluster.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp",
                                 check=False, timeout=20)  # fmt: skip
        out += events.stdout.splitlines()[-lines:]
    except (OSError, ValueError, subprocess.TimeoutExpired) as err:
        out.append(f"(no pods or events: {err})")
    try:
        text = (cluster.run / "logs" / "containerd.log").read_text(errors="replace")
        out += [line[:600] for line in text.splitlines() if "level=error" in line][-20:]
    except OSError as err:
        out.append(f"(no containerd log: {err})")
    return "\n".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and AGENTS:
        report.sections.append(("agent log (tail)", AGENTS[-1].tail(6000)))
    if report.failed and CLUSTERS:
        report.sections.append(("kubelet errors and warnings (tail)",
                                kubelet_complaints(CLUSTERS[-1])))  # fmt: skip
        report.sections.append(("pods, events, containerd errors",
                                pods_and_events(CLUSTERS[-1])))  # fmt: skip


@pytest.fixture
def pods(cluster: Cluster) -> Iterator[Callable[..., Obj]]:
    """Create pods (and claims) for one test; everything it created is deleted after it."""
    made: list[tuple[str, str, str]] = []

    def make(obj: Obj) -> Obj:
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        cluster.apply([obj])
        made.append((obj["kind"], meta["name"], meta["namespace"]))
        return obj

    yield make
    for kind, name, namespace in reversed(made):
        cluster.delete(kind, name, "-n", namespace, "--grace-period=0", "--force")


def pod(name: str, resources: dict[str, Any] | None = None, *, command: str = "sleep 3600",
        env: dict[str, str] | None = None, claims: list[dict[str, Any]] | None = None,
        container_claims: list[str] | None = None) -> Obj:  # fmt: skip
    container: dict[str, Any] = {
        "name": "app",
        "image": BUSYBOX,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", command],
    }
    if resources:
        container["resources"] = {"limits": resources}
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if container_claims:
        container.setdefault("resources", {})["claims"] = [{"name": c} for c in container_claims]
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [container],
    }
    if claims:
        spec["resourceClaims"] = claims
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def examples(path: Path) -> list[Obj]:
    return [o for o in yaml.safe_load_all(path.read_text()) if o]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line for the cluster tests of this run (`.ci/run` requires it under CI=true)."""
    counts = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        reports = terminalreporter.stats.get(outcome, [])
        counts[outcome] = sum(1 for r in reports if "cluster" in getattr(r, "keywords", {}))
    if any(counts.values()):
        line = ", ".join(f"{n} {k}" for k, n in counts.items())
        terminalreporter.write_line(f"cluster suite (Kubernetes {version()}): {line}")
