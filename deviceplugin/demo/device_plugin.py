"""The demo's device-plugin act: the example pods admitted through GetPreferredAllocation and
Allocate, as the kubelet would, and what the plugin could (and could not) know about each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from deviceplugin.demo.node import NODE, DemoNode
from deviceplugin.ledger.record import read_records
from deviceplugin.simulate.kubelet import AdmissionError

RESOURCES = ("nvidia.com/gpu-fraction", "nvidia.com/gpu-fraction.sm-sharing", "nvidia.com/gpu")
CEILING_KEY = "nvidia.com/container.{}.gpu-memory.limit"
A = "gpu-fraction.dev/"
# How the plugin found a container's ceiling: it is never told which pod an Allocate serves.
# The candidates are the pending pods asking for this many slices.
CEILING_SOURCES = {
    "annotation": "guessed: candidates agree",
    "ambiguous": "guessed: candidates disagree, lowest",
    "not-declared": "guessed: none declared",
    "no-candidates": "no candidate pod",
    "no-cache": "no pod cache",
    "invalid": "guessed: not a quantity",
}


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
    ceiling_source: str = "-"
    enforcement: str = "-"
    delivery: str = "-"
    outcome: str = "allocated"


def requests(container: dict[str, Any]) -> list[tuple[str, int]]:
    limits = (container.get("resources") or {}).get("limits") or {}
    return [(r, int(limits[r])) for r in RESOURCES if r in limits]


def bound(pod: dict[str, Any]) -> dict[str, Any]:
    """The example pod as the API server holds it once scheduled to the demo node."""
    meta = dict(pod["metadata"], namespace=pod["metadata"].get("namespace", "default"))
    return {
        **pod,
        "metadata": meta,
        "spec": dict(pod["spec"], nodeName=NODE),
        "status": {"phase": "Pending"},
    }


class DevicePluginAct:
    def __init__(self, node: DemoNode) -> None:
        self.node = node
        self.rows: list[Row] = []

    def wait_ready(self) -> None:
        kubelet = self.node.kubelet
        self.node.wait("registration", lambda: len(kubelet.resources()) == len(RESOURCES))
        # sm-sharing slices turn Healthy once GPU 0's MPS daemon runs with verified settings
        self.node.wait(
            "all slices healthy",
            lambda: all(
                self.node.healthy(r) == len(kubelet.devices(r)) for r in kubelet.resources()
            ),
        )

    def admit(self, pods: list[dict[str, Any]]) -> None:
        for pod in pods:
            self._admit_pod(pod)
            # the kubelet starts it: no longer a pending candidate for the next Allocate
            meta = pod["metadata"]
            self.node.api.update_pod(
                meta["namespace"], meta["name"], {"status": {"phase": "Running"}}
            )

    def _admit_pod(self, pod: dict[str, Any]) -> None:
        kubelet = self.node.kubelet
        name = pod["metadata"]["name"]
        annotations = pod["metadata"].get("annotations") or {}
        spec = pod["spec"]
        held: dict[str, list[str]] = {}  # resource -> IDs the init containers got
        for init, container in [(True, c) for c in spec.get("initContainers", [])] + [
            (False, c) for c in spec.get("containers", [])
        ]:
            for resource, count in requests(container):
                row = Row(name, container["name"], resource, count)
                row.declared_ceiling = annotations.get(CEILING_KEY.format(container["name"]), "-")
                self.rows.append(row)
                if resource not in kubelet.resources():
                    row.outcome = "pending: no such resource on this node"
                    continue
                try:
                    reuse = held.get(resource, [])
                    if not init and len(reuse) >= count:
                        resp = kubelet.allocate_ids(resource, reuse[:count])
                    else:
                        resp = kubelet.allocate(resource, count)
                except grpc.RpcError as exc:  # a refusal is part of the story
                    row.outcome = f"refused: {exc.code().name}: {exc.details()}"
                    continue
                except AdmissionError as exc:
                    row.outcome = f"pending: {exc}"
                    continue
                if init:  # the kubelet hands these to the app containers
                    held[resource] = list(kubelet.last_allocated)
                self._fill(row, resp, kubelet.last_allocated)

    def _fill(self, row: Row, resp: Any, ids: list[str]) -> None:
        ann = dict(resp.annotations)
        row.gpu = self.node.gpu_label(ann.get(A + "gpu", "-"))
        row.mode = ann.get(A + "mode", "-")
        row.request = ann.get(A + "request", "-")
        row.limit = ann.get(A + "limit", "-")
        row.enforcement = ann.get(A + "enforcement", "-")
        row.delivery = ann.get(A + "delivery", "-")
        record = next(
            (r for r in reversed(read_records(self.node.state)) if set(r.device_ids) == set(ids)),
            None,
        )
        if record is not None and record.ceiling_source:
            source = CEILING_SOURCES.get(record.ceiling_source, record.ceiling_source)
            row.ceiling_source = f"{source}; {record.ceiling_policy or 'limit = request'}"
