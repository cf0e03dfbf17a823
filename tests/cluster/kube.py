"""The cluster the suite runs against, as its tests use it: clients run inside its namespaces.

`Cluster` starts the node with `hack/cluster/up.sh`, runs `kubectl` (and any client) through
`hack/cluster/exec.sh`, so nothing is sent outside the cluster's network namespace, and stops
it with `down.sh`, which must leave the host as it found it. The node has a PID namespace of
its own: pids in its pid files (and an MPS daemon's) are the node's, read on the host through
`node_proc`; a process started through `exec.sh` is `nsenter`'s child (`inner_pid`).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from deviceplugin.cdi import specs as cdi_specs
from tests.cluster.requirements import CLUSTER

CDI_DIR = Path("/var/run/cdi")  # the node's, where the runtime reads CDI specs

T = TypeVar("T")
Obj = dict[str, Any]


class ClusterError(AssertionError):
    pass


def read_env(path: Path) -> dict[str, str]:
    """The run dir's `env` file (`KEY='value'` lines, as up.sh writes it)."""
    env = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip().strip("'")
    return env


@dataclass
class Cluster:
    version: str
    run: Path
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def up(cls, version: str, timeout: float = 240) -> Cluster:
        out = subprocess.run(
            [str(CLUSTER / "up.sh"), version], capture_output=True, text=True, timeout=timeout
        )
        if out.returncode != 0:
            raise ClusterError(
                f"cluster-up {version} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
            )
        run = Path(os.environ.get("GPUFRAC_CLUSTER_RUN", "/tmp/gpu-fraction-cluster"))
        return cls(version, run, read_env(run / "env"))

    def down(self) -> str:
        out = subprocess.run(
            [str(CLUSTER / "down.sh")], capture_output=True, text=True, timeout=180
        )
        if out.returncode != 0:
            raise ClusterError(f"cluster-down failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        return out.stdout

    @property
    def node(self) -> str:
        return self.env["NODE_NAME"]

    @property
    def holder(self) -> int:
        return int((self.run / "holder.pid").read_text().split()[0])

    def node_proc(self, pid: int | None = None) -> Path:
        """The node's /proc (its own PID namespace's), or one node pid's entry in it."""
        proc = Path(f"/proc/{self.holder}/root/proc")
        return proc if pid is None else proc / str(pid)

    def node_pid_file(self, name: str) -> int:
        """A daemon's pid as up.sh recorded it (`<run>/<name>.pid`): the node's pid."""
        return int((self.run / f"{name}.pid").read_text().split()[0])

    def argv(self, *cmd: str) -> list[str]:
        """`cmd` inside the cluster's network and mount namespaces, KUBECONFIG the admin's."""
        return [str(CLUSTER / "exec.sh"), *cmd]

    def sh(self, script: str, *args: str, timeout: float = 60) -> str:
        out = subprocess.run(
            self.argv("sh", "-ec", script, "sh", *args), capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
        if out.returncode != 0:
            raise ClusterError(f"in the cluster: {script[:200]!r}: {out.stderr[-2000:]}")
        return out.stdout

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        env = ["env", f"KUBECONFIG={kubeconfig}"] if kubeconfig else []
        out = subprocess.run(
            self.argv(*env, "kubectl", *args), input=input, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
        if check and out.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)}: {out.stderr.strip()[-2000:]}")
        return out

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, objects: Iterable[Obj] | str, *, server_side: bool = False) -> None:
        text = objects if isinstance(objects, str) else yaml.safe_dump_all(list(objects))
        args = ["apply", "-f", "-"] + (["--server-side"] if server_side else [])
        self.kubectl(*args, input=text)

    def delete(self, *args: str, wait: bool = True) -> None:
        self.kubectl("delete", "--ignore-not-found", f"--wait={str(wait).lower()}", *args,
                     timeout=120)  # fmt: skip

    def node_object(self) -> Obj:
        return self.get("node", self.node)  # type: ignore[no-any-return]

    def allocatable(self) -> Mapping[str, str]:
        return self.node_object()["status"].get("allocatable", {})  # type: ignore[no-any-return]

    def pod(self, name: str, namespace: str = "default") -> Obj:
        return self.get("pod", name, "-n", namespace)  # type: ignore[no-any-return]

    def claims_of(self, pod: str) -> list[Obj]:
        """The ResourceClaims pod `pod` (namespace default) uses: from templates and named."""
        obj = self.pod(pod)
        statuses = obj.get("status", {}).get("resourceClaimStatuses", [])
        names = [s["resourceClaimName"] for s in statuses if s.get("resourceClaimName")]
        for spec_claim in obj["spec"].get("resourceClaims", []):
            if spec_claim.get("resourceClaimName"):
                names.append(spec_claim["resourceClaimName"])
        return [self.get("resourceclaim", n) for n in names]

    def claim_specs(self, pods: Iterable[str]) -> set[str]:
        """The names of the CDI spec files the claims of `pods` (namespace default) have."""
        uids = {c["metadata"]["uid"] for pod in pods for c in self.claims_of(pod)}
        return {cdi_specs.claim_spec_path(CDI_DIR, uid).name for uid in uids}

    def cdi_files(self) -> set[str]:
        """The names in the node's CDI directory (a tmpfs there, as on a booted node)."""
        return set(self.sh(f"ls -1 {CDI_DIR}").split())

    def logs(self, pod: str, namespace: str = "default", container: str | None = None) -> str:
        args = ["logs", pod, "-n", namespace] + (["-c", container] if container else [])
        return self.kubectl(*args, check=False).stdout

    def events(self, namespace: str = "default", name: str | None = None) -> list[Obj]:
        items = self.get("events", "-n", namespace)["items"]
        return [e for e in items if name is None or e["involvedObject"].get("name") == name]


def wait_for(predicate: Callable[[], T | None], timeout: float, what: str, every: float = 0.5) -> T:
    """Poll `predicate` until it returns something truthy; fail naming `what`."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (ClusterError, KeyError, IndexError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}: {last}")
        time.sleep(every)


def phase(cluster: Cluster, pod: str, namespace: str = "default") -> str:
    return str(cluster.pod(pod, namespace).get("status", {}).get("phase", ""))


def wait_running(
    cluster: Cluster, pod: str, namespace: str = "default", timeout: float = 120
) -> None:
    """Until the pod is Running and Ready; on timeout the error holds what `describe` says."""
    try:
        wait_for(lambda: running(cluster, pod, namespace), timeout, f"pod {pod} Running")
    except ClusterError as exc:
        described = cluster.kubectl("describe", "pod", pod, "-n", namespace, check=False).stdout
        raise ClusterError(
            f"{exc}\n--- kubectl describe pod {pod} ---\n{described[-4000:]}"
        ) from None


def unschedulable(cluster: Cluster, pod: str, namespace: str = "default") -> str | None:
    """The scheduler's message while it cannot place the pod, else None."""
    for c in cluster.pod(pod, namespace).get("status", {}).get("conditions", []):
        if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
            return str(c.get("message", ""))
    return None


def running(cluster: Cluster, pod: str, namespace: str = "default") -> bool:
    status = cluster.pod(pod, namespace).get("status", {})
    ready = [c for c in status.get("conditions", []) if c["type"] == "Ready"]
    return status.get("phase") == "Running" and bool(ready) and ready[0]["status"] == "True"


def inner_pid(outer: int, timeout: float = 10) -> int:
    """The host pid of the command `exec.sh` started as process `outer`: once the script has
    exec'd nsenter, nsenter's one child, forked into the node's PID namespace (before that,
    the script's own children are its command substitutions). Signals meant for the command
    go there."""
    proc = Path(f"/proc/{outer}")
    deadline = time.monotonic() + timeout
    while True:
        try:
            nsenter = (proc / "comm").read_text().strip() == "nsenter"
            found = (proc / "task" / str(outer) / "children").read_text().split()
        except OSError:
            nsenter, found = False, []
        if nsenter and found:
            return int(found[0])
        if time.monotonic() > deadline:
            raise ClusterError(f"process {outer} started nothing within {timeout:.0f} s")
        time.sleep(0.02)


def restart_kubelet(cluster: Cluster, timeout: float = 30) -> int:
    """Stop the kubelet and start it again with the same command line, as a node's service
    manager would; returns the new pid (the node's)."""
    pid_file = cluster.run / "kubelet.pid"
    pid = cluster.node_pid_file("kubelet")
    proc = cluster.node_proc(pid)
    argv = (proc / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    cluster.sh('kill -TERM "$1"', str(pid))
    deadline = time.monotonic() + timeout
    while proc.exists():
        if time.monotonic() > deadline:
            raise ClusterError(f"kubelet {pid} did not stop within {timeout:.0f} s")
        time.sleep(0.1)
    log = (cluster.run / "logs" / "kubelet.log").open("ab")
    subprocess.Popen(
        cluster.argv("setsid", "sh", "-c", 'echo $$ >"$0"; exec "$@"', str(pid_file),
                     *(a.decode() for a in argv)),
        stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    return wait_for(
        lambda: (p := int(pid_file.read_text().split()[0] or 0)) != pid and p, 10, "new kubelet"
    )
