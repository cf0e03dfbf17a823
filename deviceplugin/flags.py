"""The flags of `gpu-fraction-plugin run`, written down once (DESIGN section 6).

Every flag also reads `GPU_FRACTION_<FLAG_IN_UPPER_SNAKE_CASE>`; a flag beats its variable.
The CLI, the manifests' tests and the README all read this table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    name: str  # "--kubelet-dir"
    default: str | None
    help: str
    extra_env: str | None = None  # another variable that also sets it (NODE_NAME)

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return "GPU_FRACTION_" + self.dest.upper()


DEFAULT_KUBELET_DIR = "/var/lib/kubelet/device-plugins"
DEFAULT_KUBELET_PLUGINS_DIR = "/var/lib/kubelet/plugins"
DEFAULT_KUBELET_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"

RUN_FLAGS: tuple[Flag, ...] = (
    Flag("--config", None, "config file (YAML, version: v1); none: built-in defaults"),
    Flag("--kubelet-dir", DEFAULT_KUBELET_DIR, "directory holding the kubelet's kubelet.sock"),
    Flag(
        "--pod-resources-socket",
        None,
        "kubelet pod-resources socket "
        "(default: <parent of --kubelet-dir>/pod-resources/kubelet.sock)",
    ),
    Flag("--state-dir", "/var/lib/gpu-fraction", "plugin state: allocations, health"),
    Flag("--mps-root", "/run/gpu-fraction/mps", "root of the per-GPU MPS pipe and log dirs"),
    Flag("--cdi-dir", "/var/run/cdi", "directory for this plugin's CDI specs"),
    Flag("--sysfs-root", "/sys", "sysfs root (NUMA nodes, cgroup version)"),
    Flag(
        "--host-root",
        "/",
        "where the host's root filesystem is visible, read-only: host paths the config names "
        "(cdi.nvidiaCtkPath) are checked under it",
    ),
    Flag("--node-name", None, "this node's name (also env NODE_NAME)", extra_env="NODE_NAME"),
    Flag(
        "--simulate", None, "run on simulated GPUs: a preset (h200x2, h200x8, ...) or a YAML spec"
    ),
    Flag("--metrics-address", ":9447", "address for /metrics, /healthz and /readyz"),
    Flag(
        "--kubelet-plugins-dir",
        DEFAULT_KUBELET_PLUGINS_DIR,
        "DRA: the kubelet's plugins directory (the DRA socket goes to <dir>/gpu-fraction.dev/)",
    ),
    Flag(
        "--kubelet-registry-dir",
        DEFAULT_KUBELET_REGISTRY_DIR,
        "DRA: the kubelet's plugin registration directory (watched by the kubelet)",
    ),
    Flag(
        "--dra-instance",
        None,
        "DRA rolling updates: this instance's unique id (the pod's UID, from the downward "
        "API): sockets dra-<id>.sock and gpu-fraction.dev-<id>-reg.sock, and prepare calls "
        "take turns with the node's other instance; unset: dra.sock and gpu-fraction.dev-reg.sock",
    ),
)

BY_DEST = {f.dest: f for f in RUN_FLAGS}


def resolve(flag: Flag, given: str | None, env: Mapping[str, str]) -> str | None:
    """A flag beats its GPU_FRACTION_ variable, which beats the extra variable and the default."""
    if given is not None:
        return given
    for var in (flag.env, flag.extra_env):
        if var and env.get(var):
            return env[var]
    return flag.default


def pod_resources_default(kubelet_dir: str) -> str:
    from pathlib import PurePosixPath

    return str(PurePosixPath(kubelet_dir).parent / "pod-resources" / "kubelet.sock")
