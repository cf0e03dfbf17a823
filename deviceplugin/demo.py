"""`gpu-fraction-plugin demo`: the whole story on simulated GPUs, no cluster, GPU or network.

A real `run --simulate h200x2` process (GPU 0 sm-sharing, GPU 1 time-slicing) registers with
the package's kubelet simulator; the example pods are admitted through GetPreferredAllocation
and Allocate; then an Xid 79 hits GPU 1 and GPU 0's MPS daemon is killed, and the kubelet's
view shows which slices went Unhealthy, and when they came back.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from deviceplugin.simulate.inject import inject
from deviceplugin.simulate.kubelet import AdmissionError, KubeletSimulator

PRESET = "h200x2"
RESOURCES = ("nvidia.com/gpu-fraction", "nvidia.com/gpu-fraction.sm-sharing", "nvidia.com/gpu")
CEILING_KEY = "nvidia.com/container.{}.gpu-memory.limit"
DEMO_CONFIG = """\
version: v1
gpus:
  - match: {index: 0}
    mode: sm-sharing
  - match: {index: 1}
    mode: time-slicing
health:
  quietPeriod: 2s
"""
A = "gpu-fraction.dev/"


@dataclass
class Row:
    pod: str
    container: str
    resource: str
    count: int
    gpu: str = "-"
    mode: str = "-"
    request: str = "-"
    limit: str = "-"
    declared_ceiling: str = "-"
    enforcement: str = "-"
    delivery: str = "-"
    outcome: str = "allocated"


@dataclass
class Step:
    at: float  # seconds since the fault story began
    what: str


def examples_dir() -> Path:
    here = Path(__file__).resolve().parent.parent / "daemonset" / "examples"
    return here


def pod_specs(directory: Path) -> list[dict[str, Any]]:
    """Pods in the examples, and the pod templates of Deployments (the pilot's services)."""
    pods: list[dict[str, Any]] = []
    for path in sorted(directory.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict):
                continue
            if doc.get("kind") == "Pod":
                pods.append(doc)
            elif doc.get("kind") == "Deployment":
                template = doc["spec"]["template"]
                meta = dict(template.get("metadata") or {})
                meta["name"] = doc["metadata"]["name"]
                pods.append({"kind": "Pod", "metadata": meta, "spec": template["spec"]})
    return pods


def _requests(container: dict[str, Any]) -> list[tuple[str, int]]:
    limits = (container.get("resources") or {}).get("limits") or {}
    return [(r, int(limits[r])) for r in RESOURCES if r in limits]


class Story:
    def __init__(self, work: Path, emit: Callable[[str], None]) -> None:
        self.work = work
        self.emit = emit
        self.kubelet = KubeletSimulator(work / "dp")
        self.state = work / "state"
        self.mps_root = work / "mps"
        self.config = work / "config.yaml"
        self.steps: list[Step] = []
        self.rows: list[Row] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.t0 = time.monotonic()

    def plugin_args(self) -> list[str]:
        return [
            "--simulate", PRESET,
            "--config", str(self.config),
            "--kubelet-dir", str(self.work / "dp"),
            "--state-dir", str(self.state),
            "--mps-root", str(self.mps_root),
            "--cdi-dir", str(self.work / "cdi"),
            "--pod-resources-socket", str(self.work / "pod-resources.sock"),
            "--metrics-address", "127.0.0.1:0",
        ]  # fmt: skip

    @contextlib.contextmanager
    def plugin(self) -> Iterator[None]:
        self.config.write_text(DEMO_CONFIG)
        self.kubelet.start()
        log = (self.work / "plugin.log").open("wb")
        cmd = [sys.executable, "-m", "deviceplugin", "run", *self.plugin_args()]
        env = dict(os.environ, NODE_NAME="")
        self.proc = subprocess.Popen(cmd, stderr=log, stdout=log, env=env)
        try:
            yield
        finally:
            self.stop_plugin()
            log.close()
            self.kubelet.stop()
            # the MPS daemons outlive the plugin by design; the demo leaves nothing behind
            subprocess.run(
                [sys.executable, "-m", "deviceplugin", "mps", "stop", "--all", "--force",
                 "--mps-root", str(self.mps_root), "--state-dir", str(self.state),
                 "--simulate", PRESET, "--config", str(self.config)],
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

    def wait(self, what: str, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
        if not self.kubelet.wait_for(predicate, timeout):
            raise RuntimeError(f"demo: timed out waiting for {what}; see the plugin log")

    # ---- act 1: admission -------------------------------------------------------------------
    def admit(self, pods: list[dict[str, Any]]) -> None:
        self.wait("registration", lambda: len(self.kubelet.resources()) == 2)
        # sm-sharing slices turn Healthy once GPU 0's MPS daemon runs with verified settings
        self.wait(
            "all slices healthy",
            lambda: all(
                self.healthy(r) == len(self.kubelet.devices(r)) for r in self.kubelet.resources()
            ),
        )
        for r in self.kubelet.resources():
            self.emit(f"registered {r}: {len(self.kubelet.devices(r))} slices")
        for pod in pods:
            self._admit_pod(pod)

    def _admit_pod(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        annotations = pod["metadata"].get("annotations") or {}
        spec = pod["spec"]
        held: dict[str, list[str]] = {}  # resource -> IDs the init containers got
        for init, container in [(True, c) for c in spec.get("initContainers", [])] + [
            (False, c) for c in spec.get("containers", [])
        ]:
            for resource, count in _requests(container):
                row = Row(name, container["name"], resource, count)
                row.declared_ceiling = annotations.get(CEILING_KEY.format(container["name"]), "-")
                self.rows.append(row)
                if resource not in self.kubelet.resources():
                    row.outcome = "pending: no such resource on this node"
                    continue
                try:
                    reuse = held.get(resource, [])
                    if not init and len(reuse) >= count:
                        resp = self.kubelet.allocate_ids(resource, reuse[:count])
                    else:
                        resp = self.kubelet.allocate(resource, count)
                except grpc.RpcError as exc:  # a refusal is part of the story
                    row.outcome = f"refused: {exc.code().name}: {exc.details()}"
                    continue
                except AdmissionError as exc:
                    row.outcome = f"pending: {exc}"
                    continue
                if init:  # the kubelet hands these to the app containers
                    held[resource] = list(self.kubelet.last_allocated)
                self._fill(row, resp)

    def _fill(self, row: Row, resp: Any) -> None:
        ann = dict(resp.annotations)
        gpu = ann.get(A + "gpu", "-")
        row.gpu = self._gpu_index(gpu)
        row.mode = ann.get(A + "mode", "-")
        row.request = ann.get(A + "request", "-")
        row.limit = ann.get(A + "limit", "-")
        row.enforcement = ann.get(A + "enforcement", "-")
        row.delivery = ann.get(A + "delivery", "-")

    def _gpu_index(self, uuid: str) -> str:
        for resource in self.kubelet.resources():
            for device, _, _ in self.kubelet.devices(resource):
                if device.startswith(uuid):
                    return f"{self._index.get(uuid, '?')} ({uuid[:12]}…)"
        return uuid

    @property
    def _index(self) -> dict[str, int]:
        from deviceplugin.simulate.specs import load_spec

        return {g.uuid: g.index for g in load_spec(PRESET).gpus}

    # ---- act 2: faults and recovery -------------------------------------------------------
    def healthy(self, resource: str) -> int:
        return len(self.kubelet.healthy(resource))

    def note(self, what: str) -> None:
        step = Step(round(time.monotonic() - self.t0, 2), what)
        self.steps.append(step)
        self.emit(f"  t+{step.at:5.2f}s  {what}")

    def faults(self) -> None:
        ts, sm = RESOURCES[0], RESOURCES[1]
        total_ts, total_sm = len(self.kubelet.devices(ts)), len(self.kubelet.devices(sm))
        self.t0 = time.monotonic()
        self.note(
            f"healthy: {ts} {self.healthy(ts)}/{total_ts}, {sm} {self.healthy(sm)}/{total_sm}"
        )
        inject(self.state, "1", "xid", 79)
        self.note("injected Xid 79 (GPU fell off the bus) on GPU 1 (time-slicing)")
        self.wait("GPU 1 unhealthy", lambda: self.healthy(ts) == 0)
        self.note(
            f"kubelet sees {ts} 0/{total_ts} healthy; {sm} still {self.healthy(sm)}/{total_sm}"
        )
        pid = int(
            (self.mps_root / self._uuid(0) / "pipe" / "nvidia-cuda-mps-control.pid").read_text()
        )
        os.kill(pid, signal.SIGKILL)
        self.note(f"killed GPU 0's MPS control daemon (pid {pid})")
        self.wait("GPU 0 sm-sharing unhealthy", lambda: self.healthy(sm) == 0)
        self.note(f"kubelet sees {sm} 0/{total_sm} healthy (MPS domain only)")
        self.wait("MPS daemon restarted", lambda: self.healthy(sm) == total_sm)
        self.note(f"MPS daemon restarted and probed: {sm} {total_sm}/{total_sm} healthy")
        inject(self.state, "1", "recover")
        self.note("GPU 1 answers again, recovery action NONE (operator reset done)")
        self.wait("GPU 1 healthy", lambda: self.healthy(ts) == total_ts)
        self.note(f"after the 2 s quiet period: {ts} {total_ts}/{total_ts} healthy")

    def _uuid(self, index: int) -> str:
        return next(u for u, i in self._index.items() if i == index)


COLUMNS = (
    ("pod", "pod"), ("container", "container"), ("resource", "resource"), ("n", "count"),
    ("gpu", "gpu"), ("mode", "mode"), ("request", "request"), ("limit", "limit"),
    ("ceiling declared", "declared_ceiling"), ("enforcement", "enforcement"),
    ("caps delivered as", "delivery"), ("outcome", "outcome"),
)  # fmt: skip


def table(rows: list[Row]) -> str:
    cells = [[h for h, _ in COLUMNS]] + [
        [str(getattr(r, attr)) for _, attr in COLUMNS] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def run_demo(as_json: bool = False, examples: Path | None = None) -> int:
    out: list[str] = []

    def emit(line: str) -> None:
        if as_json:
            out.append(line)
        else:
            print(line, flush=True)

    work = Path(tempfile.mkdtemp(prefix="gf-demo-", dir="/tmp"))
    story = Story(work, emit)
    code = 1
    try:
        with story.plugin():
            emit(f"simulated {PRESET}: GPU 0 sm-sharing (MPS), GPU 1 time-slicing; 1 GiB slices")
            story.admit(pod_specs(examples or examples_dir()))
            if not as_json:
                print("\nallocations (from the plugin's Allocate answers):")
                print(table(story.rows))
                print("\n(ceilings need the API server; without it the limit stays at the request)")
                print("\nfaults and recovery (the kubelet's view):")
            story.faults()
            code = story.stop_plugin() or 0
            emit(f"plugin stopped on SIGTERM, exit {code}")
    except RuntimeError as exc:
        print(str(exc), file=sys.stderr)
        log = work / "plugin.log"
        if log.exists():
            sys.stderr.write(log.read_text()[-3000:])
        code = 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if as_json:
        print(
            json.dumps(
                {
                    "allocations": [asdict(r) for r in story.rows],
                    "events": [asdict(s) for s in story.steps],
                    "log": out,
                    "exit": code,
                },
                indent=2,
            )
        )
    return code
