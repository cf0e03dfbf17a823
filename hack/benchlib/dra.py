"""DRA measurements against the real plugin process, the package's DRA kubelet simulator and
the stand-in API server: NodePrepareResources / NodeUnprepareResources for 1 and for 8 claims
per call against a bare grpcio echo of the same request, and an injected Xid to the taint in
the API server (and back after `recover`).

Every claim is allocated by the scheduler stand-in from the plugin's published slices. The
plugin reads each claim the kubelet names with one GET (several at once for an 8-claim call;
it lists and watches no claims), so a prepare makes those API round trips on its reply path:
the GETs counted during the run show how many, and the same GETs made by the bench itself
with the plugin's own claim reader, just before each call, are the round trips the target
adds to the echo. Claims are unprepared and deleted after each call, so the GPUs never fill
up.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import grpc

from benchlib import echo
from benchlib.plugin import Plugin, PluginError
from benchlib.stats import spread, summary_ms
from deviceplugin._pb import dra_v1_pb2 as pb
from deviceplugin.dra.claims import ClaimReader
from deviceplugin.dra.slices import DRIVER
from deviceplugin.kube.client import Timeouts, load_api
from deviceplugin.simulate.apiserver import FakeApiServer
from deviceplugin.simulate.dra_kubelet import DraKubeletSimulator
from deviceplugin.simulate.inject import inject
from deviceplugin.simulate.scheduler import allocate

NODE = "bench-node"
CONFIG = "version: v1\napi: dra\nsliceSize: 256Mi\nhealth: {quietPeriod: 0s}\n"
TAINT_KEY = "gpu-fraction.dev/unhealthy"
WARMUP = 10
SETTLE = 0.1  # s between allocating claims and preparing them
NAMESPACE = "bench"


class DraBench:
    def __init__(
        self, root: Path, preset: str, cdi_dir: Path | None = None, config: str = CONFIG
    ) -> None:
        self.api = FakeApiServer()
        self.plugin = Plugin(root, preset, config, cdi_dir)
        self.dra_kubelet = DraKubeletSimulator(root / "registry")
        self.plugin.extra_args = [
            "--kubelet-plugins-dir", str(root / "plugins"),
            "--kubelet-registry-dir", str(root / "registry"),
        ]  # fmt: skip
        self.serial = 0
        self.reader: ClaimReader | None = None

    def start(self) -> None:
        self.api.start()
        self.api.add_node(NODE)
        self.dra_kubelet.start()
        kubeconfig = self.api.write_kubeconfig(self.plugin.root / "kubeconfig")
        self.plugin.extra_env = {"KUBECONFIG": str(kubeconfig), "NODE_NAME": NODE}
        api = load_api({"KUBECONFIG": str(kubeconfig)}, str(self.plugin.root / "no-sa"), Timeouts())
        self.reader = ClaimReader(api) if api is not None else None
        self.plugin.start()
        try:
            self.dra_kubelet.wait_registered(DRIVER, timeout=120)
        except Exception as exc:
            raise PluginError(f"DRA driver not registered ({exc}):\n{self.plugin.tail()}") from None
        if not self.api.wait_for(lambda s: any(self._devices()), 60):
            raise PluginError(f"no ResourceSlices published:\n{self.plugin.tail()}")

    def close(self) -> None:
        if self.reader is not None:
            self.reader.stop()
        self.plugin.close()
        self.dra_kubelet.stop()
        self.api.stop()

    def _slices(self) -> list[dict[str, Any]]:
        return self.api.dra.slices_of(NODE)

    def _devices(self) -> list[dict[str, Any]]:
        return [d for s in self._slices() for d in s["spec"].get("devices") or []]

    # ---- claims --------------------------------------------------------------------------
    def _claims(self, count: int) -> list[tuple[str, str, str]]:
        """`count` claims of the smallest share, allocated and seen by the plugin's cache."""
        refs = []
        with self.api.cond:
            held = list(self.api.dra.claims.values())
        slices = self._slices()
        for _ in range(count):
            self.serial += 1
            claim: dict[str, Any] = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"namespace": NAMESPACE, "name": f"c{self.serial}"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": "time-slicing.gpu-fraction.dev",
                    "capacity": {"requests": {"memory": "256Mi"}}}}]}},
                "status": {},
            }  # fmt: skip
            claim["status"]["allocation"] = allocate(claim, slices, held, DRIVER)
            stored = self.api.dra.add_claim(claim)
            held.append(stored)
            refs.append((NAMESPACE, claim["metadata"]["name"], stored["metadata"]["uid"]))
        time.sleep(SETTLE)  # the kubelet admits the pod a while after the scheduler wrote
        return refs

    def _claim_gets(self) -> int:
        """Claim reads by name so far (a list or watch would have no name)."""
        return len(self.api.requests_for("GET", "/resourceclaims/"))

    def _round_trips(self, refs: list[tuple[str, str, str]]) -> float:
        """The GETs the prepare of `refs` needs, made from here as the plugin makes them."""
        assert self.reader is not None
        started = time.perf_counter()
        got = self.reader.get_many([(ns, name) for ns, name, _ in refs])
        took = time.perf_counter() - started
        if not all(isinstance(c, dict) for c in got.values()):
            raise PluginError(f"bench claim GETs failed: {got}")
        return took

    def _recorded(self, refs: list[tuple[str, str, str]], _api: object = None) -> bool:
        """Every claim's status holds our allocation record (the writer's background UPDATE)."""
        for ns, name, _ in refs:
            claim = self.api.dra.claims.get((ns, name)) or {}
            devices = (claim.get("status") or {}).get("devices") or []
            if not any(d.get("driver") == DRIVER and d.get("data") for d in devices):
                return False
        return True

    def _drop(self, refs: list[tuple[str, str, str]]) -> None:
        for ns, name, _ in refs:
            self.api.dra.delete_claim(ns, name)

    def prepare(self, per_call: int, calls: int, echo_stub: Any) -> dict[str, Any]:
        prepare_t: list[float] = []
        unprepare_t: list[float] = []
        echo_t: list[float] = []
        status_t: list[float] = []
        get_t: list[float] = []
        gets = 0
        for i in range(WARMUP + calls):
            refs = self._claims(per_call)
            request = pb.NodePrepareResourcesRequest(
                claims=[pb.Claim(namespace=ns, name=n, uid=u) for ns, n, u in refs]
            )
            round_trips = self._round_trips(refs)
            started = time.perf_counter()
            echo_stub(request, timeout=30)
            echoed = time.perf_counter() - started
            gets_before = self._claim_gets()
            started = time.perf_counter()
            answers = self.dra_kubelet.prepare(DRIVER, refs)
            prepared = time.perf_counter() - started
            gets += self._claim_gets() - gets_before  # during the call (an upper bound)
            errors = [a.error for a in answers.values() if a.error]
            if errors:
                raise PluginError(f"prepare refused: {errors[0]}\n{self.plugin.tail()}")
            # A pod runs a while before its claims are unprepared: long enough for the claim
            # status record, written in the background after the prepare.
            answered = time.perf_counter()
            if not self.api.wait_for(functools.partial(self._recorded, refs), 30):
                raise PluginError(f"no claim status record within 30 s:\n{self.plugin.tail()}")
            recorded = time.perf_counter() - answered
            started = time.perf_counter()
            self.dra_kubelet.unprepare(DRIVER, refs)
            unprepared = time.perf_counter() - started
            self._drop(refs)
            if i >= WARMUP:
                prepare_t.append(prepared)
                unprepare_t.append(unprepared)
                echo_t.append(echoed)
                get_t.append(round_trips)
                status_t.append(recorded)
        out: dict[str, Any] = {
            "claims_per_call": per_call,
            "prepare": summary_ms(prepare_t),
            "unprepare": summary_ms(unprepare_t),
            "echo": summary_ms(echo_t),
            "claim_gets": summary_ms(get_t),
            "answer_to_status_record": summary_ms(status_t),
            "claim_gets_per_prepare": round(gets / (WARMUP + calls), 3),
        }
        # DESIGN section 7: within 2x a bare call plus the API round trips it needs.
        for q in ("p99", "p50"):
            bare = out["echo"][f"{q}_ms"] + out["claim_gets"][f"{q}_ms"]
            out[f"ratio_{q}"] = round(out["prepare"][f"{q}_ms"] / bare, 3)
        return out

    # ---- taints --------------------------------------------------------------------------
    def taint(self, device: str) -> str | None:
        return self._taint(device)

    def _taint(self, device: str) -> str | None:
        for d in self._devices():
            if d["name"] == device:
                for t in d.get("taints") or []:
                    if t["key"] == TAINT_KEY:
                        return str(t.get("value"))
        return None

    def _wait_taint(self, device: str, present: bool, timeout: float) -> bool:
        return self.api.wait_for(lambda _: (self._taint(device) is not None) == present, timeout)

    def taints(self, cycles: int, xid: int = 79) -> dict[str, Any]:
        """`xid` then `recover` on each GPU in turn: injection to the taint in the API server."""
        names = sorted(d["name"] for d in self._devices())
        to_taint: list[float] = []
        to_clear: list[float] = []
        for cycle in range(cycles):
            device = names[cycle % len(names)]
            index = device.removeprefix("gpu-")
            started = time.monotonic()
            inject(self.plugin.state, index, "xid", xid)
            if not self._wait_taint(device, True, 10):
                raise PluginError(f"no taint on {device} within 10 s:\n{self.plugin.tail()}")
            to_taint.append(time.monotonic() - started)
            started = time.monotonic()
            inject(self.plugin.state, index, "recover")
            if not self._wait_taint(device, False, 30):
                raise PluginError(f"taint on {device} not removed in 30 s:\n{self.plugin.tail()}")
            to_clear.append(time.monotonic() - started)
        return {
            "xid": xid,
            "cycles": cycles,
            "to_taint": summary_ms(to_taint),
            "recover_to_untainted": summary_ms(to_clear),
        }


def durable_append(root: Path, count: int) -> dict[str, Any]:
    """One checkpoint-journal-sized append plus fdatasync, on the state dir's filesystem: the
    durable write each prepare call makes before it answers."""
    path = root / "bare-journal"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    times: list[float] = []
    try:
        for _ in range(count):
            started = time.perf_counter()
            os.write(fd, b"x" * 1500 + b"\n")
            os.fdatasync(fd)
            times.append(time.perf_counter() - started)
    finally:
        os.close(fd)
        path.unlink()
    return summary_ms(times)


def measure(
    root: Path, cdi_dir: Path, preset: str, calls: int, taint_cycles: int, repeats: int = 1
) -> dict[str, Any]:
    """Prepare runs of 1 and of 8 claims alternate `repeats` times (each against its echo);
    the first run of each is reported in full, every run's p99 ratio under `*_runs`."""
    bench = DraBench(root / "dra", preset, cdi_dir)
    socket = root / "dra-echo.sock"
    server = echo.start(socket)
    channel = echo.channel(socket)
    try:
        bench.start()
        grpc.channel_ready_future(channel).result(timeout=30)
        echo_stub = echo.echo_call(channel, pb.NodePrepareResourcesRequest)
        out: dict[str, Any] = {"durable_append": durable_append(root, calls)}
        runs: dict[str, list[dict[str, Any]]] = {"prepare_1": [], "prepare_8": []}
        for _ in range(repeats):
            runs["prepare_1"].append(bench.prepare(1, calls, echo_stub))
            # as many as of 1: with 100, a host stall on one echo decided the p99 ratio
            runs["prepare_8"].append(bench.prepare(8, calls, echo_stub))
        for kind, done in runs.items():
            out[kind] = done[0]
            out[f"{kind}_runs"] = spread([r["ratio_p99"] for r in done])
        out["taint"] = bench.taints(taint_cycles)
        return out
    finally:
        channel.close()
        server.terminate()
        server.wait(10)
        bench.close()
