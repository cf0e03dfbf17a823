"""A dead MPS control daemon is seen at its exit (a pidfd), not at the next liveness probe.

Through the real plugin process and the simulated control binary's real daemon process:
with `mps.probeInterval: 60s`, a SIGKILLed daemon's slices must go Unhealthy in ListAndWatch
at once, for a daemon the plugin started and for one it adopted after a restart. Without the
exit watch the probe would notice only a minute later.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.model import FaultDomain, split_slice_id
from deviceplugin.mps import layout
from deviceplugin.mps.supervisor import DaemonState, Timing
from deviceplugin.plumbing.exits import ExitWatch
from deviceplugin.simulate.kubelet import Update
from tests.conftest import MakePlugin
from tests.plugin_proc import PluginProcess
from tests.test_mps_supervisor import (
    GPU_A,
    Rig,
    gpu_plan,
    rig_in,
    slice_plan,
    started,
    wait_until,
)

SM = "nvidia.com/gpu-fraction.sm-sharing"
SLOW_PROBES = """\
version: v1
mps: {probeInterval: 60s}
gpus:
  - match: {index: 0}
    mode: sm-sharing
"""
# The benchmark holds kill -> Unhealthy to 200 ms p99; a test on a loaded shared machine gets
# more room, still 100x under the probe interval a missing watch would wait out.
BOUND = 0.5


@pytest.fixture
def rig(short_tmp: Path) -> Iterator[Rig]:
    with rig_in(short_tmp) as r:
        yield r


def _healthy_daemon(plugin: PluginProcess, event: str) -> int:
    """The pid of the daemon once the log says `event` ("started", "adopted") and the
    sm-sharing slices are Healthy (they are listed Healthy while the daemon starts too)."""
    log = plugin.log

    def ready() -> bool:
        return f"mps daemon {event}" in log.read_text()

    assert plugin.kubelet.wait_for(ready, 30), log.read_text()[-3000:]
    assert plugin.kubelet.wait_for(lambda: len(plugin.kubelet.healthy(SM)) == 139, 30)
    gpu = split_slice_id(plugin.kubelet.healthy(SM)[0])[0]
    pid = layout.read_pid(plugin.mps_root, gpu)
    assert pid is not None
    return pid


def _kill_to_unhealthy(plugin: PluginProcess, pid: int) -> float:
    """SIGKILL the daemon; seconds to the first update with every sm-sharing slice Unhealthy."""
    ep = plugin.kubelet.endpoint(SM)
    assert ep is not None
    time.sleep(0.3)  # past the 5-updates-a-second pacing of the last send
    since = len(ep.updates)
    found: list[Update] = []

    def down() -> bool:
        for update in ep.updates[since:]:
            if update.devices and all(h == "Unhealthy" for _, h, _ in update.devices):
                found.append(update)
                return True
        return False

    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert plugin.kubelet.wait_for(down, 5.0), "no Unhealthy update within 5 s of the kill"
    return found[0].at - killed


def test_a_killed_daemon_is_unhealthy_at_once_whatever_the_probe_interval(
    make_plugin: MakePlugin,
) -> None:
    plugin = make_plugin(SLOW_PROBES)
    plugin.start()
    plugin.wait_registered(2)
    pid = _healthy_daemon(plugin, "started")
    took = _kill_to_unhealthy(plugin, pid)
    assert took < BOUND, f"kill to Unhealthy took {took:.3f} s"
    # the worker's thread logs it after the fault is up (and the update may come first)
    assert plugin.kubelet.wait_for(lambda: "daemon-dead" in plugin.log.read_text(), 5)


def test_an_adopted_daemon_is_watched_too(make_plugin: MakePlugin) -> None:
    plugin = make_plugin(SLOW_PROBES)
    plugin.start()
    plugin.wait_registered(2)
    pid = _healthy_daemon(plugin, "started")
    plugin.kill_group()  # a container restart: the daemon, in its own session, lives on
    plugin.start()
    plugin.wait_registered(2)
    adopted = _healthy_daemon(plugin, "adopted")
    assert adopted == pid
    took = _kill_to_unhealthy(plugin, adopted)
    assert took < BOUND, f"kill to Unhealthy took {took:.3f} s"


def test_without_pidfd_the_probes_still_see_it_and_say_so_once(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def enosys(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", enosys)
    caplog.set_level(logging.WARNING)
    sup = started(rig, timing=Timing(probe_interval=0.2, backoff_base=0.2))
    assert sup.exit_watch.available is False and sup.exit_watch.watched() == 0
    for _ in range(2):
        os.kill(rig.pid(), signal.SIGKILL)
        wait_until(lambda: FaultDomain.MPS_DAEMON in rig.faults(), 3.0, "the probe's verdict")
        wait_until(lambda: sup.snapshot()[GPU_A].state is DaemonState.READY, what="restart")
    warned = [r for r in caplog.records if "exit watch unavailable" in r.getMessage()]
    assert len(warned) == 1


def test_the_supervisor_sees_the_exit_within_200ms_with_a_minute_between_probes(
    rig: Rig,
) -> None:
    sup = started(rig, timing=Timing(probe_interval=60.0, backoff_base=0.2))
    assert sup.exit_watch.watched() == 1
    pid = rig.pid()
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    took = wait_until(lambda: FaultDomain.MPS_DAEMON in rig.faults(), 5.0, "the exit watch")
    assert time.monotonic() - killed < BOUND, took
    assert rig.board.faults(GPU_A)[FaultDomain.MPS_DAEMON].cause == f"daemon-dead pid={pid}"
    # the worker took the probe's path: backoff, then a fresh daemon, watched in turn
    wait_until(lambda: sup.snapshot()[GPU_A].restarts == 1, what="restart")
    wait_until(lambda: sup.snapshot()[GPU_A].state is DaemonState.READY, what="ready")
    assert rig.pid() != pid and sup.exit_watch.watched() == 1


def test_a_quit_of_our_own_is_not_a_fault(rig: Rig) -> None:
    """A settings change restarts an idle daemon: its exit must not read as a death."""
    sup = started(rig, timing=Timing(probe_interval=0.2, backoff_base=0.2))
    causes: list[str] = []
    rig.board.subscribe(lambda: causes.extend(f.cause for f in rig.board.faults(GPU_A).values()))
    old = rig.pid()
    rig.mps(active_thread_percentage=50)
    sup.sync(slice_plan(gpu_plan(GPU_A)))
    wait_until(lambda: layout.read_pid(rig.root, GPU_A) not in (None, old), what="restart")
    wait_until(lambda: sup.snapshot()[GPU_A].state is DaemonState.READY, what="ready")
    assert not [c for c in causes if c.startswith("daemon-dead")], causes


def test_exit_watch_reports_a_process_gone_before_it_was_opened() -> None:
    watch = ExitWatch()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # reaped: the pid names nothing now
    pidfd = watch.open(pid)
    assert pidfd is not None and pidfd.gone
    seen: list[int] = []
    watch.watch(pidfd, lambda: seen.append(pid))
    assert seen == [pid]
    watch.close()
