"""MPS control daemon deaths against the real plugin process: SIGKILL to Unhealthy in
ListAndWatch and to the taint in the API server.

One `h200x8` node with the default MPS settings (`mps.probeInterval: 5s`) and every GPU
sm-sharing: GPUs 0-3 on the device-plugin API, 4-7 on DRA, each with its own control daemon
(the simulated binary's real process). Each round kills one daemon of each API in turn,
0.3 s after the last update of that API (past the 5-a-second pacing), and times the kill to
the update in which every slice of that GPU is Unhealthy, or to the ResourceSlice whose
device carries `gpu-fraction.dev/unhealthy`. The next round waits until every daemon is back
(Healthy, untainted), so each kill is timed alone; a GPU's restart backoff doubles with each
death, so the rounds rotate over four GPUs per API.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchlib.dra import DraBench
from benchlib.plugin import PluginError
from benchlib.stats import summary_ms
from deviceplugin.model import split_slice_id
from deviceplugin.mps import layout
from deviceplugin.plumbing.process import pid_alive

SM = "nvidia.com/gpu-fraction.sm-sharing"
CONFIG = """\
version: v1
gpus:
  - {match: {index: 0}, mode: sm-sharing}
  - {match: {index: 1}, mode: sm-sharing}
  - {match: {index: 2}, mode: sm-sharing}
  - {match: {index: 3}, mode: sm-sharing}
  - {match: {index: 4}, mode: sm-sharing, api: dra}
  - {match: {index: 5}, mode: sm-sharing, api: dra}
  - {match: {index: 6}, mode: sm-sharing, api: dra}
  - {match: {index: 7}, mode: sm-sharing, api: dra}
"""
GAP = 0.3  # s after the last update before a kill: the pacing never delays the measured one


class MpsKills:
    def __init__(self, root: Path, preset: str, cdi_dir: Path | None) -> None:
        self.node = DraBench(root, preset, cdi_dir, config=CONFIG)
        self.plugin = self.node.plugin

    def _dp_gpus(self) -> list[str]:
        devices = self.plugin.kubelet.devices(SM)
        return sorted({split_slice_id(d)[0] for d, _, _ in devices})

    def _dp_healthy(self, gpu: str) -> bool:
        mine = [h for d, h, _ in self.plugin.kubelet.devices(SM) if d.startswith(gpu + "::")]
        return bool(mine) and all(h == "Healthy" for h in mine)

    def _dp_up(self, gpu: str) -> bool:
        return self._dp_healthy(gpu) and self._pid(gpu) is not None

    def _dra_up(self, device: str, gpu: str) -> bool:
        return self.node.taint(device) is None and self._pid(gpu) is not None

    def _all_up(self, dp: list[str], dra: list[tuple[str, str]]) -> bool:
        return all(self._dp_up(g) for g in dp) and all(self._dra_up(d, g) for d, g in dra)

    def _dra_devices(self) -> dict[str, str]:
        """DRA device name -> GPU UUID, from the published slices."""
        out = {}
        for device in self.node._devices():
            uuid = (device.get("attributes") or {}).get("uuid", {}).get("string")
            if uuid:
                out[device["name"]] = uuid
        return out

    def _pid(self, gpu: str) -> int | None:
        pid = layout.read_pid(self.plugin.mps_root, gpu)
        return pid if pid is not None and pid_alive(pid) else None

    def _wait(self, what: str, ok: Callable[[], object], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            if time.monotonic() > deadline:
                raise PluginError(f"{what} not within {timeout} s:\n{self.plugin.tail()}")
            time.sleep(0.01)

    def measure(self, rounds: int) -> dict[str, Any]:
        self.node.start()
        self.plugin.wait_listed(1)
        # A DRA device is published once its daemon's first verdict is in: wait for all four.
        self._wait("every sm-sharing GPU listed", lambda: len(self._dp_gpus()) == 4, 120)
        self._wait("every DRA device published", lambda: len(self._dra_devices()) == 4, 120)
        dp = self._dp_gpus()
        dra = sorted(self._dra_devices().items())
        to_unhealthy: list[float] = []
        to_taint: list[float] = []
        for i in range(rounds):
            gpu = dp[i % len(dp)]
            device, dra_gpu = dra[i % len(dra)]
            # Every daemon back first: a kill is timed alone, as the Xid cycles are (another
            # GPU's recovery just before it would hold it for the 5-a-second pacing).
            self._wait("every daemon back", partial(self._all_up, dp, dra), 120)
            to_unhealthy.append(self._kill_dp(gpu))
            to_taint.append(self._kill_dra(device, dra_gpu))
        return {
            "rounds": rounds,
            "probe_interval_s": 5.0,
            "kill_to_unhealthy": summary_ms(to_unhealthy),
            "kill_to_taint": summary_ms(to_taint),
        }

    def _kill_dp(self, gpu: str) -> float:
        ep = self.plugin.kubelet.endpoint(SM)
        if ep is None:
            raise PluginError(f"{SM} not registered")
        time.sleep(GAP)
        since = len(ep.updates)
        pid = self._pid(gpu)
        if pid is None:
            raise PluginError(f"no live daemon for {gpu}")
        found: list[float] = []

        def down() -> bool:
            for update in ep.updates[since:]:
                mine = [h for d, h, _ in update.devices if d.startswith(gpu + "::")]
                if mine and all(h == "Unhealthy" for h in mine):
                    found.append(update.at)
                    return True
            return False

        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        if not self.plugin.kubelet.wait_for(down, 30):
            raise PluginError(f"{gpu} not Unhealthy 30 s after its daemon's kill")
        return found[0] - killed

    def _kill_dra(self, device: str, gpu: str) -> float:
        time.sleep(GAP)
        pid = self._pid(gpu)
        if pid is None:
            raise PluginError(f"no live daemon for {gpu}")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        if not self.node.api.wait_for(lambda _: self.node.taint(device) is not None, 30):
            raise PluginError(f"{device} not tainted 30 s after its daemon's kill")
        return time.monotonic() - killed

    def close(self) -> None:
        self.node.close()


def measure(root: Path, cdi_dir: Path, preset: str, rounds: int) -> dict[str, Any]:
    bench = MpsKills(root / "mps-kills", preset, cdi_dir)
    try:
        return bench.measure(rounds)
    finally:
        bench.close()
