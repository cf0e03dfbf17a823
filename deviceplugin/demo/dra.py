"""The demo's DRA act: the example ResourceClaimTemplates become claims, the scheduler stand-in
allocates them from the plugin's published slices, the DRA kubelet prepares them, and each
claim's `status.devices` record says what it got. Nothing is guessed: the plugin is handed
the claim, its amount and its ceiling."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from deviceplugin.demo.node import DRA_GPUS, DemoNode
from deviceplugin.dra.slices import DRIVER
from deviceplugin.simulate.scheduler import CLASS_SUFFIX, Unschedulable, allocate

NAMESPACE = "default"
STATUS_WAIT = 5.0  # s; the plugin writes claim status off the prepare reply path


@dataclass
class ClaimRow:
    pod: str
    claim: str
    device_class: str
    asked: str
    device: str = "-"
    mode: str = "-"
    request: str = "-"
    limit: str = "-"
    declared_ceiling: str = "-"
    ceiling_source: str = "-"
    enforcement: str = "-"
    outcome: str = "prepared"


def workloads(docs: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    """(pod, claim name, claim spec) for every pod claim made from a template in `docs`."""
    templates = {
        d["metadata"]["name"]: d["spec"]["spec"]
        for d in docs
        if d.get("kind") == "ResourceClaimTemplate"
    }
    out = []
    for pod in (d for d in docs if d.get("kind") == "Pod"):
        for entry in pod["spec"].get("resourceClaims") or []:
            template = templates.get(entry.get("resourceClaimTemplateName", ""))
            if template is not None:
                out.append(
                    (
                        pod["metadata"]["name"],
                        f"{pod['metadata']['name']}-{entry['name']}",
                        template,
                    )
                )
    return out


def _asked(spec: dict[str, Any]) -> tuple[str, str, str]:
    (request,) = spec["devices"]["requests"]
    exactly = request["exactly"]
    memory = ((exactly.get("capacity") or {}).get("requests") or {}).get("memory")
    count = int(exactly.get("count", 1))
    asked = f"{memory or 'whole GPU'}" + (f" x{count}" if count > 1 else "")
    ceiling = "-"
    for config in spec["devices"].get("config") or []:
        ceiling = ((config.get("opaque") or {}).get("parameters") or {}).get("memoryLimit", ceiling)
    return exactly["deviceClassName"], asked, ceiling


class DraAct:
    def __init__(self, node: DemoNode) -> None:
        self.node = node
        self.rows: list[ClaimRow] = []

    def wait_ready(self) -> None:
        self.node.wait("DRA registration", self.node.dra_registered)
        # like the kubelet's all-Healthy wait: the sm-sharing GPU is published only once its
        # MPS daemon has been judged (running with verified settings), and then untainted
        self.node.wait("every DRA GPU published, untainted", self._all_published_untainted)

    def _all_published_untainted(self) -> bool:
        devices = [d for s in self.node.slices() for d in s["spec"].get("devices") or []]
        return len(devices) == len(DRA_GPUS) and not any(d.get("taints") for d in devices)

    def claims(self) -> list[dict[str, Any]]:
        with self.node.api.cond:
            return list(self.node.api.dra.claims.values())

    def schedule(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """A claim allocated as the scheduler would; raises Unschedulable."""
        claim: dict[str, Any] = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": NAMESPACE, "name": name},
            "spec": spec,
            "status": {},
        }
        claim["status"]["allocation"] = allocate(claim, self.node.slices(), self.claims(), DRIVER)
        return claim

    def admit(self, docs: list[dict[str, Any]]) -> None:
        for pod, name, spec in workloads(docs):
            device_class, asked, ceiling = _asked(spec)
            base = ClaimRow(
                pod,
                name,
                device_class.removesuffix(CLASS_SUFFIX),
                asked,
                declared_ceiling=ceiling,
            )
            try:
                claim = self.schedule(name, spec)
            except Unschedulable as exc:
                base.outcome = f"pending: {exc}"
                self.rows.append(base)
                continue
            stored = self.node.api.dra.add_claim(claim)
            uid = stored["metadata"]["uid"]
            answer = self.node.dra_kubelet.prepare(DRIVER, [(NAMESPACE, name, uid)])[uid]
            if answer.error:
                base.outcome = f"refused: {answer.error}"
                self.rows.append(base)
                continue
            self.rows += self._rows(base, stored)

    def _rows(self, base: ClaimRow, claim: dict[str, Any]) -> list[ClaimRow]:
        key = (NAMESPACE, claim["metadata"]["name"])
        results = claim["status"]["allocation"]["devices"]["results"]
        deadline = time.monotonic() + STATUS_WAIT
        while True:
            with self.node.api.cond:
                status = self.node.api.dra.claims[key].get("status") or {}
            records = {
                (d["pool"], d["device"], d.get("shareID")): d for d in status.get("devices") or []
            }
            if len(records) >= len(results) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        rows = []
        for r in results:
            row = ClaimRow(**vars(base))
            index = int(r["device"].removeprefix("gpu-"))
            row.device = f"{r['device']} ({self.node.uuids[index][:12]}…)"
            record = (records.get((r["pool"], r["device"], r.get("shareID"))) or {}).get("data")
            if record is None:
                row.outcome = "prepared (no status record written)"
            else:
                self._fill(row, record)
            rows.append(row)
        return rows

    @staticmethod
    def _fill(row: ClaimRow, record: dict[str, Any]) -> None:
        row.mode = record.get("mode", "-")
        row.request = f"{record['requestMiB']}Mi" if record.get("requestMiB") else "-"
        row.limit = f"{record['limitMiB']}Mi" if record.get("limitMiB") else "-"
        enforcement = record.get("enforcement") or "-"
        row.enforcement = enforcement if isinstance(enforcement, str) else ",".join(enforcement)
        ceiling = record.get("ceiling") or {}
        source = ceiling.get("source")
        if source:  # e.g. "claim default/x config (FromClaim)": the claim said it
            told = "the claim's config" if str(source).startswith("claim ") else source
            row.ceiling_source = f"told: {told}; {ceiling.get('outcome') or '-'}"
