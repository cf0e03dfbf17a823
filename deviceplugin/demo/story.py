"""`gpu-fraction-plugin demo`: the whole story on one simulated node, both APIs side by side.

A real `run --simulate` process serves GPUs 0-2 through the device-plugin API and GPUs 3-5
through DRA (one GPU of each mode per API) against the package's kubelet simulators and a
stand-in API server. The example pods are admitted through Allocate (the plugin has to guess
each pod's ceiling) and the example claims through NodePrepareResources (it is told). Then
the same faults hit one GPU of each API: the kubelet's device-plugin view can only hide
slices, the DRA view taints the device with the cause, and both come back after recovery.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from deviceplugin.demo.device_plugin import RESOURCES, DevicePluginAct, Row, bound
from deviceplugin.demo.dra import ClaimRow, DraAct, workloads
from deviceplugin.demo.node import DRA_GPUS, DemoError, DemoNode
from deviceplugin.simulate.inject import inject
from deviceplugin.simulate.scheduler import Unschedulable

TAINT_KEY = "gpu-fraction.dev/unhealthy"
TS, SM = RESOURCES[0], RESOURCES[1]
TS_DP, SM_DP, SM_DRA, TS_DRA = 1, 0, 3, 4  # GPU indexes the faults hit


@dataclass
class Step:
    at: float  # seconds since the fault story began
    what: str


def examples_dir() -> Path:
    return Path(__file__).resolve().parent.parent.parent / "daemonset" / "examples"


def example_docs(directory: Path) -> list[dict[str, Any]]:
    """Every object in the examples; Deployments (the pilot's services) as their pod."""
    docs: list[dict[str, Any]] = []
    for path in sorted(directory.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict):
                continue
            if doc.get("kind") == "Deployment":
                template = doc["spec"]["template"]
                meta = dict(template.get("metadata") or {}, name=doc["metadata"]["name"])
                doc = {"kind": "Pod", "metadata": meta, "spec": template["spec"]}
            docs.append(doc)
    return docs


def device_plugin_pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == "Pod" and not d["spec"].get("resourceClaims")]


class Faults:
    def __init__(self, node: DemoNode, dra: DraAct, emit: Callable[[str], None]) -> None:
        self.node = node
        self.dra = dra
        self.emit = emit
        self.steps: list[Step] = []
        self.t0 = time.monotonic()

    def note(self, what: str) -> None:
        step = Step(round(time.monotonic() - self.t0, 2), what)
        self.steps.append(step)
        self.emit(f"  t+{step.at:5.2f}s  {what}")

    def taint(self, index: int) -> str | None:
        for t in self.node.taints(index):
            if t["key"] == TAINT_KEY:
                return f"{t['key']}={t['value']}:{t['effect']}"
        return None

    def others_untouched(self, index: int) -> str:
        clean = [f"gpu-{i}" for i in DRA_GPUS if i != index and not self.node.taints(i)]
        return ", ".join(clean) or "none"

    def run(self) -> None:
        node = self.node
        total_ts, total_sm = len(node.kubelet.devices(TS)), len(node.kubelet.devices(SM))
        self.t0 = time.monotonic()
        self.note(
            f"device plugin: {TS} {node.healthy(TS)}/{total_ts}, {SM} "
            f"{node.healthy(SM)}/{total_sm} healthy; DRA: no taints"
        )
        # ---- one Xid 79 on a GPU of each API
        inject(node.state, str(TS_DP), "xid", 79)
        inject(node.state, str(TS_DRA), "xid", 79)
        self.note(
            f"injected Xid 79 (GPU fell off the bus) on GPU {TS_DP} (device plugin) "
            f"and GPU {TS_DRA} (DRA), both time-slicing"
        )
        node.wait("device-plugin GPU unhealthy", lambda: node.healthy(TS) == 0)
        self.note(
            f"device plugin: kubelet sees {TS} 0/{total_ts} healthy (it can only hide "
            f"the slices, not say why); {SM} still {node.healthy(SM)}/{total_sm}"
        )
        node.wait("DRA taint", lambda: self.taint(TS_DRA))
        self.note(
            f"DRA: gpu-{TS_DRA} tainted {self.taint(TS_DRA)} in its ResourceSlice; "
            f"untouched: {self.others_untouched(TS_DRA)}"
        )
        self.try_new_claim()
        # ---- an MPS daemon killed on a GPU of each API
        pids = {i: node.mps_pid(i) for i in (SM_DP, SM_DRA)}
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        self.note(
            f"killed the MPS control daemons of GPU {SM_DP} (device plugin, pid "
            f"{pids[SM_DP]}) and GPU {SM_DRA} (DRA, pid {pids[SM_DRA]})"
        )
        node.wait("device-plugin MPS unhealthy", lambda: node.healthy(SM) == 0)
        self.note(f"device plugin: kubelet sees {SM} 0/{total_sm} healthy (MPS domain only)")
        node.wait("DRA MPS taint", lambda: self.taint(SM_DRA))
        self.note(f"DRA: gpu-{SM_DRA} tainted {self.taint(SM_DRA)} (MPS domain only)")
        node.wait(
            "MPS daemons restarted", lambda: node.healthy(SM) == total_sm and not self.taint(SM_DRA)
        )
        self.note(
            f"MPS daemons restarted and probed: {SM} {total_sm}/{total_sm} healthy, "
            f"gpu-{SM_DRA} taint removed"
        )
        # ---- recovery
        inject(node.state, str(TS_DP), "recover")
        inject(node.state, str(TS_DRA), "recover")
        self.note(f"GPUs {TS_DP} and {TS_DRA} answer again, recovery action NONE (reset done)")
        node.wait("device-plugin GPU healthy", lambda: node.healthy(TS) == total_ts)
        node.wait("DRA taint removed", lambda: not self.taint(TS_DRA))
        self.note(
            f"after the 2 s quiet period: {TS} {total_ts}/{total_ts} healthy and "
            f"gpu-{TS_DRA}'s taint removed (NVIDIA's DRA driver never removes its taints)"
        )

    def try_new_claim(self) -> None:
        spec = {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "time-slicing.gpu-fraction.dev",
                            "capacity": {"requests": {"memory": "4Gi"}},
                        },
                    }
                ]
            }
        }
        try:
            self.dra.schedule("probe-while-tainted", spec)
        except Unschedulable as exc:
            self.note(f"DRA: a new 4Gi time-slicing claim is not schedulable: {exc}")
        else:
            raise DemoError("demo: the scheduler stand-in placed a claim on a tainted device")


def table(rows: Sequence[Any], columns: Sequence[tuple[str, str]]) -> str:
    cells = [[h for h, _ in columns]] + [[str(getattr(r, a)) for _, a in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def _columns(row_type: type, headers: dict[str, str]) -> list[tuple[str, str]]:
    return [(headers.get(f.name, f.name.replace("_", " ")), f.name) for f in fields(row_type)]


DP_HEADERS = {
    "count": "n",
    "declared_ceiling": "ceiling declared",
    "ceiling_source": "how the plugin found it",
    "delivery": "caps delivered as",
}
DRA_HEADERS = {
    "device_class": "class",
    "declared_ceiling": "ceiling declared",
    "ceiling_source": "how the plugin found it",
}


def run_demo(as_json: bool = False, examples: Path | None = None) -> int:
    out: list[str] = []

    def emit(line: str) -> None:
        if as_json:
            out.append(line)
        else:
            print(line, flush=True)

    def say(text: str) -> None:
        if not as_json:
            print(text, flush=True)

    directory = examples or examples_dir()
    docs = example_docs(directory)
    dp_pods = device_plugin_pods(docs)
    if not dp_pods or not workloads(docs):
        # An installed package has no source tree beside it: say so rather than tell the
        # story with empty tables.
        print(
            f"demo: no example pods for both APIs under {directory} (the source tree's "
            "daemonset/examples); pass --examples DIR",
            file=sys.stderr,
        )
        return 2
    pods = [bound(p) for p in dp_pods]
    work = Path(tempfile.mkdtemp(prefix="gf-demo-", dir="/tmp"))
    node = DemoNode(work)
    dp, dra = DevicePluginAct(node), DraAct(node)
    faults = Faults(node, dra, emit)
    code = 1
    try:
        with node.running(pods):
            emit(
                "simulated node: 6 H200s; GPUs 0-2 on the device-plugin API, GPUs 3-5 on DRA "
                "(sm-sharing, time-slicing, exclusive each); 1 GiB slices"
            )
            dp.wait_ready()
            dra.wait_ready()
            for r in node.kubelet.resources():
                emit(f"device plugin: registered {r}: {len(node.kubelet.devices(r))} slices")
            emit(f"DRA: registered driver gpu-fraction.dev, {len(node.slices())} ResourceSlice(s)")
            dp.admit(pods)
            dra.admit(docs)
            say("\ndevice-plugin API (from the plugin's Allocate answers and records):")
            say(table(dp.rows, _columns(Row, DP_HEADERS)))
            say("\nDRA (from each claim's status.devices record, written by the plugin):")
            say(table(dra.rows, _columns(ClaimRow, DRA_HEADERS)))
            say(
                "\nAllocate is never told which pod it serves, so a ceiling is guessed from the "
                "pending pods; a claim carries its amount and ceiling, so nothing is guessed."
            )
            say("\nfaults and recovery, as each API shows them:")
            faults.run()
            code = node.stop_plugin() or 0
            emit(f"plugin stopped on SIGTERM, exit {code}")
    except DemoError as exc:
        print(str(exc), file=sys.stderr)
        if node.log.exists():
            sys.stderr.write(node.log.read_text()[-3000:])
        code = 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if as_json:
        data = {
            "allocations": [asdict(r) for r in dp.rows],
            "claims": [asdict(r) for r in dra.rows],
            "events": [asdict(s) for s in faults.steps],
            "log": out,
            "exit": code,
        }
        print(json.dumps(data, indent=2))
    return code
