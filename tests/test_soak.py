"""Soak and fault suites (`make soak`): the real plugin process through many restarts and faults.

Each test warms up, samples the plugin's fds/threads/RSS from /proc, repeats its event many
times, checks after each that every resource is registered and nothing live was lost, then
samples again and prints the figures. `SOAK_SCALE=0.1` shortens every loop for a quick look.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from deviceplugin.config.settings import Config, MpsConfig
from deviceplugin.health.board import HealthBoard
from deviceplugin.ledger.record import read_records
from deviceplugin.model import FaultDomain
from deviceplugin.mps import layout
from deviceplugin.mps.supervisor import MpsSupervisor
from deviceplugin.simulate import mps_control as fake_mps
from deviceplugin.simulate.inject import inject
from tests import soak_util
from tests import test_mps_supervisor as t
from tests.conftest import MakePlugin
from tests.fakes.podresources import Assigned, FakePodResources
from tests.plugin_proc import PluginProcess

pytestmark = pytest.mark.soak

SCALE = float(os.environ.get("SOAK_SCALE", "1"))
TS, SM = "nvidia.com/gpu-fraction", "nvidia.com/gpu-fraction.sm-sharing"
SPLIT = """\
version: v1
health: {quietPeriod: 0s}
gpus:
  - match: {index: 0}
    mode: sm-sharing
  - match: {index: 1}
    mode: time-slicing
"""
SLICES = 139  # per GPU on h200x2 at the default slice size


def n(count: int) -> int:
    return max(1, int(count * SCALE))


@pytest.fixture
def plugin(make_plugin: MakePlugin) -> PluginProcess:
    return make_plugin(SPLIT)


def pid_of(p: PluginProcess) -> int:
    assert p.proc is not None and p.proc.poll() is None, p.log.read_text()[-3000:]
    return p.proc.pid


def registered(p: PluginProcess, timeout: float = 30.0) -> None:
    ok = p.kubelet.wait_for(
        lambda: (
            sorted(p.kubelet.resources()) == [TS, SM]
            and len(p.kubelet.devices(TS)) == SLICES == len(p.kubelet.devices(SM))
        ),
        timeout,
    )
    assert ok, p.log.read_text()[-3000:]


def sockets(p: PluginProcess) -> set[Path]:
    return {ep.socket for r in (TS, SM) if (ep := p.kubelet.endpoint(r)) is not None}


def registered_anew(p: PluginProcess, old: set[Path], timeout: float = 30.0) -> None:
    """Registered by a new plugin instance (its sockets have new names)."""
    assert p.kubelet.wait_for(lambda: not sockets(p) & old and len(sockets(p)) == 2, timeout)
    registered(p, timeout)


def all_healthy(p: PluginProcess, timeout: float = 60.0) -> None:
    ok = p.kubelet.wait_for(
        lambda: len(p.kubelet.healthy(TS)) == SLICES == len(p.kubelet.healthy(SM)), timeout
    )
    assert ok, (len(p.kubelet.healthy(TS)), len(p.kubelet.healthy(SM)), p.log.read_text()[-3000:])


def emit(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(f"\n{line}", flush=True)


def records(p: PluginProcess) -> set[tuple[str, ...]]:
    return {r.key for r in read_records(p.state)}


def own_specs(p: PluginProcess) -> list[Path]:
    return [f for f in p.cdi.iterdir() if f.name.startswith("gpu-fraction")]


def test_kubelet_restarts(plugin: PluginProcess, capsys: pytest.CaptureFixture[str]) -> None:
    plugin.start()
    registered(plugin)
    for _ in range(3):  # warm-up: the first restarts allocate pools that then stay
        plugin.kubelet.restart()
        registered(plugin)
    before, started = soak_util.sample(pid_of(plugin)), time.monotonic()
    count = n(100)
    for _ in range(count):
        plugin.kubelet.restart()
        registered(plugin)
    time.sleep(1.0)  # let closed streams finish their cleanup
    after = soak_util.sample(pid_of(plugin))
    emit(
        capsys,
        soak_util.report("kubelet-restarts", count, before, after, time.monotonic() - started),
    )
    soak_util.check(before, after)


def test_plugin_restarts_adopt_mps_daemons(
    plugin: PluginProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    plugin.start()
    registered(plugin)
    all_healthy(plugin)
    plugin.kubelet.allocate(SM, 2)
    plugin.kubelet.allocate(TS, 3)
    live = records(plugin)
    specs = sorted(f.name for f in own_specs(plugin))
    assert len(live) == 2 and len(specs) == 2
    gpu = next(iter(layout.known_gpus(plugin.mps_root)))
    daemon = layout.read_pid(plugin.mps_root, gpu)
    assert daemon is not None
    first = soak_util.sample(pid_of(plugin))
    started = time.monotonic()
    count = n(20)
    ways = ["SIGTERM", "SIGKILL", "process group"]
    for i in range(count):
        way = ways[i % 3]
        old = sockets(plugin)
        if way == "process group":
            plugin.kill_group()
        else:
            plugin.terminate(getattr(signal, way))
        plugin.start()
        registered_anew(plugin, old)
        all_healthy(plugin)
        # The same MPS daemon, adopted (never restarted), and nothing live lost.
        assert layout.read_pid(plugin.mps_root, gpu) == daemon, way
        os.kill(daemon, 0)
        assert records(plugin) == live, way
        assert sorted(f.name for f in own_specs(plugin)) == specs, way
    last = soak_util.sample(pid_of(plugin))
    emit(
        capsys,
        soak_util.report("plugin-restarts", count, first, last, time.monotonic() - started)
        + f" mps_pid={daemon} (same each time)",
    )
    soak_util.check(first, last)


def test_allocations(short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = PluginProcess(short_tmp, config=SPLIT)
    pods = FakePodResources(short_tmp / "pr.sock").start()
    window: collections.deque[tuple[str, str, list[str]]] = collections.deque()

    def listed() -> None:
        pods.set(
            *(Assigned("soak", name, "c", resource, tuple(ids)) for name, resource, ids in window)
        )

    groups: dict[str, list[list[str]]] = {}

    def one(i: int) -> None:
        # Fixed device groups, taken round-robin: a group comes back only after it was
        # released (and usually reconciled), like pods of one size on a busy node.
        # sm-sharing rarely: records stay for the ledger's 60 s grace after release, and a
        # GPU's live sm-sharing records are capped at mps.maxClients (48).
        resource = SM if i % 250 == 0 else TS
        if resource not in groups:
            ids = sorted(d for d, _, _ in p.kubelet.devices(resource))
            groups[resource] = [ids[k : k + 2] for k in range(0, len(ids) - 1, 2)]
        ids = groups[resource][i % len(groups[resource])]
        answer = p.kubelet.allocate_ids(resource, ids)
        window.append((f"pod-{i}", resource, ids))
        assert answer.cdi_devices
        if len(window) > 40:
            _, old_resource, old_ids = window.popleft()
            p.kubelet.release(old_resource, old_ids)
        listed()

    try:
        p.start()
        registered(p)
        all_healthy(p)
        for i in range(200):
            one(i)
        before, started = soak_util.sample(pid_of(p)), time.monotonic()
        count = n(10_000)
        for i in range(200, 200 + count):
            one(i)
        # Released allocations are reconciled away; every live one keeps its record and spec.
        live = {tuple(sorted(ids)) for _, _, ids in window}
        assert p.kubelet.wait_for(lambda: {tuple(sorted(k)) for k in records(p)} == live, 120), (
            len(records(p)),
            len(live),
        )
        assert p.kubelet.wait_for(lambda: len(own_specs(p)) == len(live), 30)
        registered(p)
        after = soak_util.sample(pid_of(p))
        emit(
            capsys,
            soak_util.report("allocations", count, before, after, time.monotonic() - started),
        )
        soak_util.check(before, after)
    finally:
        pods.stop()
        p.cleanup()


FAULTS = [("0", "xid", 79), ("1", "xid", 48), ("0", "xid", 13), ("0", "mps-fault", None),
          ("1", "lost", None), ("1", "xid", 79)]  # fmt: skip


def faulted(p: PluginProcess, resource: str) -> Callable[[], bool]:
    return lambda: not p.kubelet.healthy(resource)


def test_fault_injections(plugin: PluginProcess, capsys: pytest.CaptureFixture[str]) -> None:
    plugin.start()
    registered(plugin)
    all_healthy(plugin)
    before, started = soak_util.sample(pid_of(plugin)), time.monotonic()
    count = n(1000)
    for i in range(count):
        gpu, action, xid = FAULTS[i % len(FAULTS)]
        assert inject(plugin.state, gpu, action, xid, timeout=10)["ok"]
        if i % 50 == 0:  # sampled: the kubelet sees the fault, then the recovery
            assert plugin.kubelet.wait_for(faulted(plugin, SM if gpu == "0" else TS), 30)
        assert inject(plugin.state, gpu, "recover", timeout=10)["ok"]
        if i % 50 == 0:
            all_healthy(plugin)
    all_healthy(plugin)
    registered(plugin)
    after = soak_util.sample(pid_of(plugin))
    emit(
        capsys,
        soak_util.report("fault-injections", count, before, after, time.monotonic() - started),
    )
    soak_util.check(before, after)


def test_config_reloads(plugin: PluginProcess, capsys: pytest.CaptureFixture[str]) -> None:
    plugin.start()
    registered(plugin)
    good = [SPLIT + f"mps: {{activeThreadPercentage: {pct}}}\n" for pct in (50, 100)]
    bad = SPLIT + "sliceSize: 0\n"

    def logged(word: str) -> int:
        return plugin.log.read_text().count(word)

    def reload(text: str, word: str) -> None:
        seen = logged(word)
        plugin.config.write_text(text)
        assert plugin.proc is not None
        plugin.proc.send_signal(signal.SIGHUP)
        assert plugin.kubelet.wait_for(lambda: logged(word) > seen, 30), plugin.log.read_text()[
            -2000:
        ]
        registered(plugin)

    for i in range(4):
        reload(good[i % 2], "msg=reloaded")
    before, started = soak_util.sample(pid_of(plugin)), time.monotonic()
    count = n(50)
    for i in range(count):
        if i % 2:
            reload(bad, "reload rejected")
        else:
            reload(good[(i // 2) % 2], "msg=reloaded")
    after = soak_util.sample(pid_of(plugin))
    emit(
        capsys, soak_util.report("config-reloads", count, before, after, time.monotonic() - started)
    )
    soak_util.check(before, after)


def test_mps_daemon_kills(short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The real supervisor and fake control binary in this process, with the backoff reset
    # after every recovery (stable_reset=0): the plugin's default backoff grows to 30 s on a
    # daemon that keeps dying, which is the point in production and too slow for 50 kills here.
    binary = fake_mps.write_launcher(short_tmp / "nvidia-cuda-mps-control")
    config = Config(mps=MpsConfig(control_binary=str(binary)))
    rig = t.Rig(short_tmp / "mps", binary, HealthBoard(), t.RecordingModes(), config)
    timing = dataclasses.replace(t.FAST, stable_reset=0.0)
    try:
        sup = t.started(rig, timing=timing)
        for _ in range(3):
            kill_and_recover(rig, sup)
        before, started = soak_util.sample(os.getpid()), time.monotonic()
        count = n(50)
        for _ in range(count):
            kill_and_recover(rig, sup)
        after = soak_util.sample(os.getpid())
        assert sup.snapshot()[t.GPU_A].restarts == count + 3
        emit(
            capsys,
            soak_util.report("mps-daemon-kills", count, before, after, time.monotonic() - started),
        )
        soak_util.check(before, after)
    finally:
        for s in rig.sups:
            s.stop()
        t.kill_everything(rig.root)


def kill_and_recover(rig: t.Rig, sup: MpsSupervisor) -> None:
    old = rig.pid()
    os.kill(old, signal.SIGKILL)
    t.wait_until(lambda: FaultDomain.MPS_DAEMON in rig.faults(), 10, "daemon death seen")
    t.wait_until(lambda: rig.faults() == set() and rig.pid() != old, 30, "daemon restarted")
