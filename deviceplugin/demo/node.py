"""The demo's node: a stand-in API server, both kubelet simulators and a real
`run --simulate` plugin process, all in one temporary directory, torn down completely."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from deviceplugin.dra.slices import DRIVER
from deviceplugin.simulate.apiserver import FakeApiServer
from deviceplugin.simulate.dra_kubelet import DraKubeletSimulator
from deviceplugin.simulate.kubelet import KubeletSimulator
from deviceplugin.simulate.specs import load_spec

NODE = "demo-node"
# Six H200s: each API serves each mode, so the same workloads can be compared side by side.
SPEC = """\
name: demo-node
driverVersion: "615.43.02"
gpus:
  - {name: NVIDIA H200, memoryMiB: 143771, count: 6}
"""
CONFIG = """\
version: v1
gpus:
  - {match: {index: 0}, mode: sm-sharing}
  - {match: {index: 1}, mode: time-slicing}
  - {match: {index: 2}, mode: exclusive}
  - {match: {index: 3}, mode: sm-sharing, api: dra}
  - {match: {index: 4}, mode: time-slicing, api: dra}
  - {match: {index: 5}, mode: exclusive, api: dra}
mps:
  protocolVersion: 3  # per-client memory accounting: borrowed memory can be reclaimed
health:
  quietPeriod: 2s
"""
DP_GPUS, DRA_GPUS = (0, 1, 2), (3, 4, 5)


class DemoError(RuntimeError):
    """Something the story waited for did not happen; the plugin log says why."""


class DemoNode:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.spec = work / "node.yaml"
        self.config = work / "config.yaml"
        self.state = work / "state"
        self.mps_root = work / "mps"
        self.cdi = work / "cdi"
        self.log = work / "plugin.log"
        self.api = FakeApiServer()
        self.kubelet = KubeletSimulator(work / "dp")
        self.dra_kubelet = DraKubeletSimulator(work / "registry")
        self.proc: subprocess.Popen[bytes] | None = None
        self.spec.write_text(SPEC)
        self.config.write_text(CONFIG)
        self.uuids = {g.index: g.uuid for g in load_spec(self.spec).gpus}

    def args(self) -> list[str]:
        return [
            "--simulate", str(self.spec),
            "--config", str(self.config),
            "--kubelet-dir", str(self.work / "dp"),
            "--kubelet-plugins-dir", str(self.work / "plugins"),
            "--kubelet-registry-dir", str(self.work / "registry"),
            "--state-dir", str(self.state),
            "--mps-root", str(self.mps_root),
            "--cdi-dir", str(self.cdi),
            "--pod-resources-socket", str(self.work / "pod-resources.sock"),
            "--metrics-address", "127.0.0.1:0",
        ]  # fmt: skip

    @contextlib.contextmanager
    def running(self, pods: list[dict[str, Any]]) -> Iterator[DemoNode]:
        """The API server (holding `pods`, pending on this node), both kubelets, the plugin."""
        self.api.start()
        self.api.add_node(NODE)
        for pod in pods:
            self.api.add_pod(pod)
        kubeconfig = self.api.write_kubeconfig(self.work / "kubeconfig")
        self.kubelet.start()
        self.dra_kubelet.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_FRACTION_")}
        env.update(KUBECONFIG=str(kubeconfig), NODE_NAME=NODE)
        log = self.log.open("wb")
        cmd = [sys.executable, "-m", "deviceplugin", "run", *self.args()]
        self.proc = subprocess.Popen(cmd, stderr=log, stdout=log, env=env)
        try:
            yield self
        finally:
            self.stop_plugin()
            log.close()
            self.kubelet.stop()
            self.dra_kubelet.stop()
            self.api.stop()
            # the MPS daemons outlive the plugin by design; the demo leaves nothing behind
            subprocess.run(
                [sys.executable, "-m", "deviceplugin", "mps", "stop", "--all", "--force",
                 "--mps-root", str(self.mps_root), "--state-dir", str(self.state),
                 "--simulate", str(self.spec), "--config", str(self.config)],
                capture_output=True, check=False, timeout=60,
            )  # fmt: skip

    def stop_plugin(self) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def wait(self, what: str, predicate: Callable[[], object], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise DemoError(f"demo: timed out waiting for {what}; see the plugin log")
            if self.proc is not None and self.proc.poll() is not None:
                raise DemoError(f"demo: the plugin exited ({self.proc.returncode}) during {what}")
            time.sleep(0.02)

    # ---- what each API shows -----------------------------------------------------------
    def healthy(self, resource: str) -> int:
        return len(self.kubelet.healthy(resource))

    def slices(self) -> list[dict[str, Any]]:
        return self.api.dra.slices_of(NODE)

    def taints(self, index: int) -> list[dict[str, Any]]:
        """The taints on GPU `index`'s device in the published slices."""
        return [
            t
            for s in self.slices()
            for d in s["spec"].get("devices") or []
            if d["name"] == f"gpu-{index}"
            for t in d.get("taints") or []
        ]

    def dra_registered(self) -> bool:
        return self.dra_kubelet.plugin(DRIVER) is not None

    def mps_pid(self, index: int) -> int:
        pid_file = self.mps_root / self.uuids[index] / "pipe" / "nvidia-cuda-mps-control.pid"
        return int(pid_file.read_text())

    def gpu_label(self, uuid: str) -> str:
        index = next((i for i, u in self.uuids.items() if u == uuid), None)
        return uuid if index is None else f"{index} ({uuid[:12]}…)"
