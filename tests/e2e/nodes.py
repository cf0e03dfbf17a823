"""The simulated node the e2e modules run the plugin on, and what a container should get.

One plugin process per `deviceListStrategy` (GPU 0 time-slicing, GPU 1 sm-sharing, GPUs 2
and 3 exclusive), started inside the namespace on first use; answers come from the kubelet
simulator, one per mode, taken once and replayed by every container of that strategy (the
kubelet replays an answer for the pod's whole life too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deviceplugin.mps import layout
from deviceplugin.simulate.cdi import BIN_DIR, LIB_DIR
from deviceplugin.simulate.specs import SimGpu
from tests.e2e.conftest import E2E
from tests.e2e.runtime import NVIDIA_MAJOR, UVM_MAJOR, Ran, hook_records
from tests.plugin_proc import PluginProcess

TS = "nvidia.com/gpu-fraction"
SM = "nvidia.com/gpu-fraction.sm-sharing"
EX = "nvidia.com/gpu"
MODES = {"time-slicing": (TS, 2), "sm-sharing": (SM, 1), "exclusive": (EX, 1)}
STRATEGIES = ("cdi", "envvar", "device-nodes")
SLICE_MIB = 1024
VISIBLE = "NVIDIA_VISIBLE_DEVICES"
CONTROL_NODES = {
    "/dev/nvidiactl": (NVIDIA_MAJOR, 255),
    "/dev/nvidia-uvm": (UVM_MAJOR, 0),
    "/dev/nvidia-uvm-tools": (UVM_MAJOR, 1),
}


def config(
    strategy: str, ctk: str, api: str = "device-plugin", extra: str = "", driver_root: str = "/"
) -> str:
    # Without CDI nothing applies the memory-limit hook: time-slicing needs best-effort.
    enforcement = "required" if strategy == "cdi" else "best-effort"
    return f"""\
version: v1
api: {api}
deviceListStrategy: [{strategy}]
enforcement: {enforcement}
cdi: {{nvidiaCtkPath: {ctk}, driverRoot: {driver_root}}}
gpus:
  - {{match: {{index: 0}}, mode: time-slicing}}
  - {{match: {{index: 1}}, mode: sm-sharing}}
  - {{match: {{index: 2}}, mode: exclusive}}
  - {{match: {{index: 3}}, mode: exclusive}}
{extra}"""


@dataclass
class DpNode:
    e2e: E2E
    strategy: str
    plugin: PluginProcess
    answers: dict[str, Any] = field(default_factory=dict)

    def start(self) -> None:
        self.plugin.start()
        self.plugin.wait_registered(3, timeout=60)
        kubelet = self.plugin.kubelet
        assert kubelet.wait_for(lambda: bool(kubelet.healthy(SM)), 30), self.log()

    def log(self) -> str:
        return self.plugin.log.read_text()[-3000:]

    def answer(self, mode: str) -> Any:
        """The kubelet's Allocate answer for one container of `mode`, taken once."""
        if mode not in self.answers:
            resource, count = MODES[mode]
            self.answers[mode] = self.plugin.kubelet.allocate(resource, count)
        return self.answers[mode]

    def gpu(self, answer: Any) -> SimGpu:
        return self.e2e.spec.gpu(answer.annotations["gpu-fraction.dev/gpu"])


def expected_nodes(strategy: str, gpu: SimGpu) -> dict[str, tuple[int, int]]:
    """/dev/nvidia* a container should hold: its own GPU's and the control nodes, from the
    toolkit's CDI device or the device specs; nothing under `envvar` (on a node the legacy
    runtime hook injects them from NVIDIA_VISIBLE_DEVICES, and none runs here)."""
    if strategy == "envvar":
        return {}
    return {f"/dev/nvidia{gpu.minor}": (NVIDIA_MAJOR, gpu.minor), **CONTROL_NODES}


def expected_caps(mode: str, mib: int | None = None) -> dict[str, str]:
    """The caps a container of `mode` sees (`mib`: request = limit; default: MODES' count)."""
    if mode == "exclusive":
        return {}
    mib = mib if mib is not None else MODES[mode][1] * SLICE_MIB
    caps = {"NVIDIA_GPU_MEMORY_REQUEST": str(mib), "NVIDIA_GPU_MEMORY_LIMIT": str(mib)}
    if mode == "sm-sharing":
        caps["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={mib}M"
    return caps


def bound_from(ran: Ran, where: str) -> str:
    """The root (fourth field of mountinfo) of the mount at `where`: the path inside the
    source filesystem, which says which host file a bind came from."""
    (root,) = [ln.split()[3] for ln in ran.sections["mounts"] if ln.split()[4] == where]
    return root


def assert_started(ran: Ran) -> None:
    assert ran.rc == 0, (ran.rc, ran.stderr[-3000:])


def assert_container(
    e2e: E2E,
    ran: Ran,
    *,
    strategy: str,
    mode: str,
    gpu: SimGpu,
    mps_root: Path,
    caps: dict[str, str],
    driver_root: str = "/",
) -> None:
    """Everything a container of `mode` on `gpu` must have got under `strategy` (the
    driver's files from `driver_root`: `/run/nvidia/driver` on GPU Operator nodes)."""
    assert_started(ran)
    env = ran.env
    # NVIDIA_VISIBLE_DEVICES: the toolkit's `void` under CDI (ours never sets it), the GPU
    # in plain env.
    assert env.get(VISIBLE) == ("void" if strategy == "cdi" else gpu.uuid), env
    for name, value in caps.items():
        assert env.get(name) == value, (name, env)
    if mode == "exclusive":
        assert not [k for k in env if k.startswith(("NVIDIA_GPU_MEMORY", "CUDA_MPS"))]

    assert ran.nodes() == expected_nodes(strategy, gpu)
    libs = set(ran.sections.get("libs", []))
    driver_libs = {f"libcuda.so.{e2e.spec.driver_version}"}
    assert driver_libs <= libs if strategy == "cdi" else not libs & driver_libs
    smi = f"{BIN_DIR}/nvidia-smi"
    assert (smi in ran.mount_points()) == (strategy == "cdi")
    # `nvidia-smi -L`, then its status: under `cdi` the toolkit's spec mounts the binary and
    # it lists the container's one GPU node; else nothing mounts it (on a node the legacy
    # hook would) and sh finds no such command.
    listed = ran.sections["smi"]
    if strategy == "cdi":
        assert listed == [f"GPU 0: NVIDIA stand-in (minor {gpu.minor})", "rc=0"], listed
    else:
        assert listed[-1] == "rc=127" and listed[0].endswith("nvidia-smi: not found"), listed
    if strategy == "cdi":  # bound from under the driver root (its mount's root says which)
        (libcuda,) = driver_libs
        for where in (f"{LIB_DIR}/{libcuda}", smi):
            name = where.rsplit("/", 1)[1]
            # the host layout's: the overlay on the file's dir; the operator's: the /run tmpfs
            host = (
                f"/{name}" if driver_root == "/" else f"{driver_root}{where}".removeprefix("/run")
            )
            assert bound_from(ran, where) == host, where

    shm_dir = layout.shm_dir(mps_root, gpu.uuid)
    if mode == "sm-sharing":
        pipe = layout.pipe_dir(mps_root, gpu.uuid)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)  # the daemon's own path string
        assert {str(pipe), "/dev/shm"} <= ran.mount_points()
        served = sorted(os.listdir(pipe))
        assert served, "the daemon serves nothing in its pipe dir"
        assert sorted(ran.sections["pipe"]) == sorted([".", "..", *served])
        # /dev/shm is the daemon's: the container's file is in <mps-root>/<uuid>/shm and in
        # the /dev/shm of the daemon's own mount namespace.
        written = f"written by {ran.tag}\n"
        assert (shm_dir / ran.tag).read_text() == written
        pid = layout.pid_file(mps_root, gpu.uuid).read_text().split()[0]
        assert e2e.ns.run("nsenter", "-t", pid, "-m", "cat", f"/dev/shm/{ran.tag}") == written
    else:
        assert not [k for k in env if k.startswith("CUDA_MPS")]
        assert not (shm_dir / ran.tag).exists()

    hooks = hook_records(e2e.hook_records, ran.cid)
    limits = [h for h in hooks if h["argv"][1:3] == ["hook", "apply-cuda-memory-limits"]]
    if strategy == "cdi" and mode == "time-slicing":
        (hook,) = limits
        assert hook["argv"][3:] == ["--driver-root", driver_root, "--gpu-id", gpu.uuid]
        state = hook["state"]
        assert state["pid"] > 0 and state["id"] == ran.cid
        assert ran.cid in hook["cgroup"], hook["cgroup"]  # the cgroup it would limit
        limit = caps["NVIDIA_GPU_MEMORY_LIMIT"]
        assert f"NVIDIA_GPU_MEMORY_LIMIT={limit}" in hook["env"]  # what the real hook reads
    else:
        assert limits == []
    ldcache = [h for h in hooks if h["argv"][1:3] == ["hook", "update-ldcache"]]
    assert len(ldcache) == (1 if strategy == "cdi" else 0)  # the toolkit spec's own hook
