"""The real plugin on the real node: `gpu-fraction-plugin run --simulate` as a host process.

It runs inside the cluster's namespaces against the kubelet's real directories and
pod-resources socket, on stand-in `/dev/nvidia*` nodes and driver libraries (as the podman
suite has them, here inside the cluster's mount namespace), with API credentials that carry
exactly what the shipped manifests grant: a token of the shipped ServiceAccount, bound by the
shipped roles, never the admin's. A missing permission fails a test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deviceplugin.simulate.cdi import BIN_DIR, LIB_DIR, binary_paths, library_paths, write_binaries
from deviceplugin.simulate.specs import SimSpec, parse_spec
from tests.cluster.kube import CDI_DIR, Cluster, Obj, inner_pid, wait_for
from tests.cluster.requirements import REPO
from tests.e2e.runtime import NVIDIA_MAJOR, UVM_MAJOR, write_stub_ctk

TS = "nvidia.com/gpu-fraction"
SM = "nvidia.com/gpu-fraction.sm-sharing"
EX = "nvidia.com/gpu"
NODE_SPEC = """\
name: gf-cluster-node
driverVersion: "615.43.02"
gpus:
  - {name: NVIDIA H200, memoryMiB: 143771, count: 7}
"""
# GPUs 0-2 on the device-plugin API, 3-6 on DRA: one of each sharing mode on each, and a
# second time-slicing GPU on DRA for claims that span two GPUs.
DP_GPUS, DRA_GPUS = (0, 1, 2), (3, 4, 5, 6)
CONFIG = """\
version: v1
gpus:
  - {{match: {{index: 0}}, mode: time-slicing}}
  - {{match: {{index: 1}}, mode: sm-sharing}}
  - {{match: {{index: 2}}, mode: exclusive}}
  - {{match: {{index: 3}}, mode: time-slicing, api: dra}}
  - {{match: {{index: 4}}, mode: sm-sharing, api: dra}}
  - {{match: {{index: 5}}, mode: exclusive, api: dra}}
  - {{match: {{index: 6}}, mode: time-slicing, api: dra}}
cdi: {{nvidiaCtkPath: {ctk}}}
mps: {{protocolVersion: 3}}
health: {{quietPeriod: 1s}}
dra: {{unhealthyTaintEffect: {effect}}}
"""
# The node's conventional paths, as a DaemonSet pod would mount them.
KUBELET = Path("/var/lib/kubelet")
MPS_ROOT = Path("/run/gpu-fraction/mps")  # a tmpfs on a node: empty after a reboot
# What the agent may be granted: the shipped RBAC, admission policies and DeviceClasses.
GRANTS = {
    "Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
    "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "DeviceClass",
}  # fmt: skip

# Stand-in GPUs inside the cluster's mount namespace: an overlay on /dev (the submounts
# bound back on top) with the device nodes, an overlay on the driver library directory with
# files named as the simulated toolkit spec mounts them, and one on the binary directory
# with the simulator's stand-in binaries (nvidia-smi), which the spec mounts into every GPU
# container. No helper bind: the overlays are mounted straight on their directories. $1:
# scratch dir (its bin/ holds the stand-ins); then "name major minor" triples, "--",
# library paths, "--", binary paths.
_STAND_IN = r"""
ns="$1"; shift
mkdir -p "$ns/olddev" "$ns/dev-up" "$ns/dev-work" "$ns/lib-up" "$ns/lib-work" \
  "$ns/bin-up" "$ns/bin-work"
mount --rbind /dev "$ns/olddev"
# The node's / is rshared: the copy must not be a peer of /dev, or the overlay mounted on
# /dev would be mounted on it too, and unmounting the copy would take the overlay with it
# (device nodes would then land on the host's devtmpfs).
mount --make-rprivate "$ns/olddev"
mount -t overlay overlay -o "lowerdir=/dev,upperdir=$ns/dev-up,workdir=$ns/dev-work" /dev
for sub in $(awk '$5 ~ "^/dev/" {print $5}' /proc/self/mountinfo | sort -u); do
  [ -d "$ns/olddev/${sub#/dev/}" ] && mount --rbind "$ns/olddev/${sub#/dev/}" "$sub"
done
umount -R "$ns/olddev"
[ "$(stat -f -c %T /dev)" = overlayfs ] || { echo "/dev is not the stand-in overlay" >&2; exit 1; }
while [ "$1" != "--" ]; do mknod -m 666 "/dev/$1" c "$2" "$3"; shift 3; done
shift
mount -t overlay overlay -o "lowerdir=LIBDIR,upperdir=$ns/lib-up,workdir=$ns/lib-work" LIBDIR
mount -t overlay overlay -o "lowerdir=BINDIR,upperdir=$ns/bin-up,workdir=$ns/bin-work" BINDIR
[ "$(stat -f -c %T BINDIR)" = overlayfs ] || { echo "BINDIR: not the overlay" >&2; exit 1; }
while [ "$1" != "--" ]; do
  case "$1" in LIBDIR/*) ;; *) echo "refusing to write $1 outside LIBDIR" >&2; exit 1 ;; esac
  echo "stand-in driver library" > "$1"; shift
done
shift
for bin in "$@"; do
  case "$bin" in BINDIR/*) ;; *) echo "refusing to write $bin outside BINDIR" >&2; exit 1 ;; esac
  cp "$ns/bin/${bin##*/}" "$bin"; chmod 755 "$bin"
done
""".replace("LIBDIR", LIB_DIR).replace("BINDIR", BIN_DIR)


def node_spec() -> SimSpec:
    return parse_spec(yaml.safe_load(NODE_SPEC), source="cluster suite node")


def stand_in_gpus(cluster: Cluster, spec: SimSpec) -> None:
    """The host files the simulated toolkit spec names (host layout): device nodes,
    libraries and binaries, inside the cluster's mount namespace only."""
    nodes = [f"nvidia{g.minor} {NVIDIA_MAJOR} {g.minor}" for g in spec.gpus]
    nodes += [f"nvidiactl {NVIDIA_MAJOR} 255", f"nvidia-uvm {UVM_MAJOR} 0"]
    nodes += [f"nvidia-uvm-tools {UVM_MAJOR} 1"]
    triples = [part for node in nodes for part in node.split()]
    scratch = cluster.run / "gpu-stand-in"
    scratch.mkdir(exist_ok=True)
    write_binaries(scratch / "bin")
    cluster.sh(
        _STAND_IN, str(scratch), *triples, "--", *library_paths(spec), "--", *binary_paths(spec)
    )


def render(cluster: Cluster, *components: str) -> list[Obj]:
    """The shipped manifests as the real kustomize renders them: the base plus `components`."""
    with tempfile.TemporaryDirectory(dir=cluster.run) as tmp:
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [os.path.relpath(REPO / "daemonset" / "base", tmp)],
            "components": [
                os.path.relpath(REPO / "daemonset" / "components" / c, tmp) for c in components
            ],
        }
        Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        text = cluster.kubectl("kustomize", tmp).stdout
    return [o for o in yaml.safe_load_all(text) if o]


def grant(cluster: Cluster) -> tuple[str, str]:
    """Apply the shipped RBAC, policies and classes; returns the agent's (namespace, SA)."""
    objects = render(cluster, "admission-policy", "dra")
    granted = [o for o in objects if o["kind"] in GRANTS]
    cluster.apply(sorted(granted, key=lambda o: o["kind"] != "Namespace"))
    sa = next(o for o in objects if o["kind"] == "ServiceAccount")
    return sa["metadata"]["namespace"], sa["metadata"]["name"]


HOLDER_POD = "gpu-fraction-agent"


def holder_pod(cluster: Cluster, namespace: str, account: str) -> Obj:
    """The pod the agent's token is bound to, on this node, as the DaemonSet's pod would be:
    a token bound to a pod names its node (`authentication.kubernetes.io/node-name`), which
    the shipped admission policies key on."""
    cluster.apply([{
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": HOLDER_POD, "namespace": namespace},
        "spec": {
            "serviceAccountName": account,
            "nodeName": cluster.node,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "hold", "image": "localhost/gpu-fraction/busybox:1",
                            "imagePullPolicy": "Never", "command": ["sleep", "86400"]}],
        },
    }])  # fmt: skip
    return wait_for(
        lambda: cluster.get("pod", HOLDER_POD, "-n", namespace).get("metadata", {}).get("uid")
        and cluster.get("pod", HOLDER_POD, "-n", namespace),
        30, "the agent's pod",
    )  # fmt: skip


def agent_kubeconfig(cluster: Cluster, namespace: str, account: str, path: Path) -> Path:
    holder = holder_pod(cluster, namespace, account)
    token = cluster.kubectl(
        "create", "token", account, "-n", namespace, "--duration", "6h",
        "--bound-object-kind", "Pod", "--bound-object-name", HOLDER_POD,
        "--bound-object-uid", holder["metadata"]["uid"],
    ).stdout.strip()  # fmt: skip
    admin = yaml.safe_load((cluster.run / "admin.kubeconfig").read_text())
    server = admin["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "node", "cluster": server}],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "agent", "context": {"cluster": "node", "user": "agent"}}],
        "current-context": "agent",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@dataclass
class Agent:
    cluster: Cluster
    root: Path  # state dir, log, config: on disk in the run dir
    kubeconfig: Path
    effect: str = "NoSchedule"
    proc: subprocess.Popen[bytes] | None = None  # exec.sh's nsenter: the agent is its child
    pid: int = 0  # the agent's host pid (inner_pid): signals go here, not to nsenter
    mark: int = 0  # the log's size when this process started: what it logged comes after

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def log(self) -> Path:
        return self.root / "plugin.log"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    def write_config(self, effect: str | None = None) -> None:
        self.effect = effect or self.effect
        ctk = write_stub_ctk(self.root / "toolkit" / "nvidia-ctk", self.root / "hooks.jsonl")
        self.config.write_text(CONFIG.format(ctk=ctk, effect=self.effect))
        (self.root / "node.yaml").write_text(NODE_SPEC)

    def args(self) -> list[str]:
        return [
            "--simulate", str(self.root / "node.yaml"),
            "--config", str(self.config),
            "--kubelet-dir", str(KUBELET / "device-plugins"),
            "--pod-resources-socket", str(KUBELET / "pod-resources" / "kubelet.sock"),
            "--kubelet-plugins-dir", str(KUBELET / "plugins"),
            "--kubelet-registry-dir", str(KUBELET / "plugins_registry"),
            "--state-dir", str(self.state),
            "--mps-root", str(MPS_ROOT),
            "--cdi-dir", str(CDI_DIR),
            "--metrics-address", "127.0.0.1:0",
        ]  # fmt: skip

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "agent already running"
        env = [
            "env", f"KUBECONFIG={self.kubeconfig}", f"NODE_NAME={self.cluster.node}",
            f"PYTHONPATH={REPO}",
        ]  # fmt: skip
        self.mark = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.cluster.argv(*env, sys.executable, "-m", "deviceplugin", "run", *self.args()),
                stdout=log, stderr=log, start_new_session=True,
            )  # fmt: skip
        self.pid = inner_pid(self.proc.pid)

    def since_start(self) -> str:
        return self.log.read_bytes()[self.mark :].decode(errors="replace")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text()[-n:] if self.log.exists() else ""

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """`sig` to the agent; its exit status (nsenter passes it on)."""
        proc, self.proc = self.proc, None
        assert proc is not None
        os.kill(self.pid, sig)
        return proc.wait(timeout)

    def kill_group(self) -> None:
        proc, self.proc = self.proc, None
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def mps_stop(self) -> None:
        subprocess.run(
            self.cluster.argv(
                "env", f"PYTHONPATH={REPO}", sys.executable, "-m", "deviceplugin", "mps", "stop",
                "--all", "--force", "--mps-root", str(MPS_ROOT), "--state-dir", str(self.state),
                "--simulate", str(self.root / "node.yaml"), "--config", str(self.config),
            ),
            capture_output=True, check=False, timeout=60,
        )  # fmt: skip

    def inject(self, gpu: int, *what: str) -> None:
        """`gpu-fraction-plugin simulate inject` into the running agent (`--xid 79`, ...)."""
        out = subprocess.run(
            self.cluster.argv(
                "env", f"PYTHONPATH={REPO}", sys.executable, "-m", "deviceplugin", "simulate",
                "inject", "--state-dir", str(self.state), "--gpu", str(gpu), *what,
            ),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, f"inject {what} on GPU {gpu}: {out.stderr}\n{self.tail()}"

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)  # nsenter waits for it
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None
        self.mps_stop()


def wait_serving(cluster: Cluster, agent: Agent, timeout: float = 90) -> dict[str, Any]:
    """Until the Node's allocatable lists the three device-plugin resources and the agent's
    DRA driver has published its ResourceSlices; returns the allocatable."""

    def ready() -> dict[str, Any] | None:
        if agent.proc is not None and agent.proc.poll() is not None:
            raise AssertionError(f"agent exited {agent.proc.returncode}:\n{agent.tail()}")
        if "msg=running" not in agent.since_start():  # this process serves (not the last one)
            return None
        alloc = dict(cluster.allocatable())
        if not all(int(alloc.get(r, "0")) > 0 for r in (TS, SM, EX)):
            return None
        slices = cluster.get("resourceslices")["items"]
        mine = [s for s in slices if s["spec"].get("nodeName") == cluster.node]
        return alloc if mine else None

    try:
        return wait_for(ready, timeout, "the agent to register and publish")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- agent log ---\n{agent.tail()}") from None


def wait_gone(pred: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError("timed out")


@contextlib.contextmanager
def serving_agent(cluster: Cluster) -> Iterator[Agent]:
    """The plugin on the node as the suite and `figures.py` use it: stand-in GPUs, the shipped
    grants, a pod-bound token, the suite's config; serving when entered, stopped on exit."""
    stand_in_gpus(cluster, node_spec())
    namespace, account = grant(cluster)
    root = cluster.run / "agent"
    root.mkdir()
    agent = Agent(cluster, root, agent_kubeconfig(cluster, namespace, account, root / "kubeconfig"))
    agent.write_config()
    agent.start()
    try:
        wait_serving(cluster, agent)
        yield agent
    finally:
        agent.close()
